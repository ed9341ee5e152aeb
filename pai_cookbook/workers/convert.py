"""The conversion worker: streaming Hugging Face safetensors <-> torch_dist I/O, and resharding.

Its job is a `core.launching.jobs.ConvertJob`, checked in the notebook process before launch:
- hf2mcore writes PyTorch Distributed Checkpoint (DCP) files itself, with the chunk layout Megatron-Core's
  own save would produce (taken from a model built on the meta device, so it costs no memory); each
  chunk is read from its safetensors shard, converted (`hf_mapping`) and written just before it is
  needed, then dropped.
- mcore2hf loads the checkpoint one parameter at a time (only that parameter's chunks are read) and
  writes safetensors shards as they fill up.
- reshard loads a checkpoint at a layout with Megatron-Core and saves it from there.
"""

from __future__ import annotations

import json
import resource
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint, families, hf_mapping, mxfp4
from pai_cookbook.core.checkpoints.hf_checkpoint import HFCheckpoint, inspect_hf
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ModelConfig, ParallelConfig, PrecisionConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import DEFAULT_SHARD_BYTES, ConvertJob
from pai_cookbook.workers import adapters
from pai_cookbook.workers.dcp_layout import Chunk, chunk_layout, iter_megatron_params, unwritten_chunks

WRITE_THREADS = 2  # HF -> Megatron: DCP writer threads, each building and writing its own file


class _HFReader:
    """Reads HF tensors one at a time (the shard is opened per read: resident memory stays one tensor)."""

    def __init__(self, source: HFCheckpoint):
        self.source = source

    def __call__(self, name: str) -> torch.Tensor:
        base, row = hf_mapping.stacked(name)  # a stacked expert's row is read alone
        if base not in self.source.tensors:  # stored in MXFP4: dequantized, and transposed to transformers' layout
            blocks, scales = (self._read(base + suffix, row) for suffix in mxfp4.SUFFIXES)
            return hf_mapping.check_finite(name, mxfp4.dequantize(blocks, scales, self.source.dtype).transpose(-1, -2),
                                           str(self.source.folder / self.source.tensors[base + "_blocks"][0]))
        path = self.source.folder / self.source.tensors[base][0]
        return hf_mapping.check_finite(name, self._read(base, row), str(path))

    def _read(self, name: str, row: int | None) -> torch.Tensor:
        from safetensors import safe_open

        key = self.source.stored.get(name, name)  # a multimodal model's language model is stored under a prefix
        with safe_open(self.source.folder / self.source.tensors[name][0], framework="pt") as f:
            return f.get_tensor(key) if row is None else f.get_slice(key)[row]


def _lazy_planner(model: ModelConfig, read: _HFReader, chunks: list[Chunk], padded_vocab: int):
    """A Megatron-Core save planner whose tensor data is built from HF tensors when DCP writes it."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    by_index = {(c.key, c.offsets): c for c in chunks}
    pending: dict[str, int] = {}
    for c in chunks:
        pending[c.param] = pending.get(c.param, 0) + 1

    class LazyPlanner(MCoreSavePlanner):
        # Parameters being written; one is dropped as soon as its last chunk (fc1 has two) is written,
        # so the working set is about one parameter per writing thread whatever order DCP writes in.
        # DCP's writer threads call resolve_data concurrently: a parameter is built once (its own lock;
        # another thread wanting it waits for it, threads building different ones do not wait).
        live: dict[str, torch.Tensor] = {}
        building: dict[str, threading.Lock] = {}
        guard = threading.Lock()

        def param(self, name: str) -> torch.Tensor:
            with self.guard:
                lock = self.building.setdefault(name, threading.Lock())
            with lock:
                if name not in self.live:
                    kind, hf_names = hf_mapping.hf_names(name, model)
                    built = hf_mapping.to_megatron(kind, [read(n) for n in hf_names], model, padded_vocab)
                    if not built.is_contiguous() or built.storage_offset():  # a transposed or stacked expert's row:
                        built = built.clone(memory_format=torch.contiguous_format)  # chunk views index its storage from 0
                    self.live[name] = built
                return self.live[name]

        errors: list[BaseException] = []  # a writer thread's exception ends only that thread: kept, raised after

        def resolve_data(self, write_item):
            chunk = by_index.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
            if chunk is None:  # bytes (extra state): real, tiny, already in the state dict
                return super().resolve_data(write_item)
            try:
                data = self.param(chunk.param).as_strided(*chunk.view).reshape(chunk.sizes).contiguous()
            except BaseException as err:
                self.errors.append(err)
                raise
            with self.guard:
                pending[chunk.param] -= 1
                if pending[chunk.param] == 0:
                    del self.live[chunk.param], self.building[chunk.param]
            return data

    return LazyPlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False)


@contextmanager
def _without_zip_crc32():
    """DCP stores each chunk as a `torch.save` zip record; skip the zip CRC-32 of each record while writing.

    `torch.load`, which is how DCP and Megatron-Core read a chunk, never checks it, so the field protects nothing
    they read, and computing it is about half of `torch.save`'s time (measured: 1,400 -> 2,500 MB/s for a 100 MB
    bf16 tensor on tmpfs). Integrity is the caller's rename-on-success plus the chunk check after saving."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def write_megatron(source: HFCheckpoint, partial: Path) -> dict[str, Any]:
    """Stream `source` into a torch_dist checkpoint in `partial` (runs in a 1-process worker)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, save
    from torch.distributed.checkpoint.api import CheckpointException

    model, dtype = source.model, source.dtype
    chunks, pyt_state, _ = chunk_layout(model, dtype)
    planner = _lazy_planner(model, _HFReader(source), chunks, model.padded_vocab_size(1))
    try:
        with _without_zip_crc32():
            save(pyt_state, planner=planner,
                 storage_writer=FileSystemWriter(partial, single_file_per_rank=True, thread_count=WRITE_THREADS))
    except CheckpointException as err:  # DCP wraps the writing thread's error (a BaseException): raise the cause
        (cause, _), *_ = err.failures.values()
        raise (planner.errors[0] if planner.errors else cause) from None
    # DCP's extra writer threads die alone on an exception and `save` still writes the metadata: check that
    # every chunk was built and stored, or the caller would publish a checkpoint with holes.
    if planner.errors:
        raise planner.errors[0]
    unwritten = unwritten_chunks(chunks, FileSystemReader(partial).read_metadata())
    if unwritten:
        raise RuntimeError(f"{len(unwritten)} of {len(chunks)} chunks were not written (first: {unwritten[0].key} at "
                           f"{unwritten[0].offsets}): a writer thread failed; its traceback is in this worker's log.")
    torch.save({}, partial / "common.pt")  # a model-only checkpoint has no common (non-sharded) state
    save_config(CheckpointingConfig(sharded_backend="torch_dist", sharded_backend_version=1), str(partial))
    checkpoint.write_config(partial, model, dtype, source=str(source.folder))
    checkpoint.copy_assets(source.folder, partial / checkpoint.HF_ASSETS)
    families.native_config_json(partial / checkpoint.HF_ASSETS / "config.json")  # Kimi-K2's as DeepSeek-V3's
    # a multimodal source's vision tower and projector stay in the source: said, not dropped silently
    return {"chunks": len(chunks), "dtype": checkpoint.DTYPE_NAMES[dtype]} | (
        {"vision_tensors_left": source.left_out} if source.left_out else {})


def write_hf(ckpt: Path, partial: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Export a torch_dist checkpoint's tensors to HF safetensors shards + index in `partial`, with its tokenizer
    assets (1-process worker); a reward model's scalar head as `score.weight`. The caller adds config.json.

    A full shard is written by a background thread while the next one is read (safetensors' write releases the
    GIL): at most two shards are in memory, the one being written and the one filling, and where experts are stored
    stacked (GPT-OSS) one stacked tensor being filled."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from safetensors.torch import save_file

    model, dtype = checkpoint.read_config(ckpt)
    head = checkpoint.head(ckpt)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, files, weight_map, total = 0, [], {}, 0
    stacks: dict[str, tuple[torch.Tensor, set[int]]] = {}  # stacked experts: the tensor, the rows not yet written
    writing: Future | None = None

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="safetensors-writer") as writer:
        def flush() -> None:
            nonlocal shard, shard_bytes, writing
            if writing is not None:
                writing.result()  # the previous shard is on disk (or its error is raised here)
            name = f"model-{len(files) + 1:05d}.safetensors"  # renamed to -of-N below, once N is known
            writing = writer.submit(save_file, shard, partial / name, metadata={"format": "pt"})
            files.append(name)
            shard, shard_bytes = {}, 0

        for name, tensor in iter_megatron_params(ckpt, model, dtype, head):
            hf_mapping.check_finite(name, tensor, str(ckpt))
            kind, hf_names = ("copy", ("score.weight",)) if head == "reward" and name == "output_layer.weight" \
                else hf_mapping.hf_names(name, model)
            for hf_name, hf_tensor in zip(hf_names, hf_mapping.to_hf(kind, tensor, model)):
                hf_name, row = hf_mapping.stacked(hf_name)
                if row is not None:  # a row of a stacked tensor, copied in (the reader reuses its buffers)
                    stack, missing = stacks.setdefault(hf_name, (hf_tensor.new_empty(model.num_experts, *hf_tensor.shape),
                                                                 set(range(model.num_experts))))
                    stack[row].copy_(hf_tensor)
                    missing.discard(row)
                    if missing:
                        continue
                    hf_tensor = stacks.pop(hf_name)[0]
                size = hf_tensor.numel() * hf_tensor.element_size()
                if shard_bytes and shard_bytes + size > max_shard_bytes:
                    flush()
                shard[hf_name] = hf_tensor.contiguous()
                shard_bytes += size
                total += size
                weight_map[hf_name] = len(files)
        if stacks:
            raise RuntimeError(f"the checkpoint lacks rows of stacked expert tensors: "
                               f"{ {name: sorted(missing) for name, (_, missing) in stacks.items()} }")
        if shard:
            flush()
        if writing is not None:
            writing.result()
    final_names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for old, new in zip(files, final_names):
        (partial / old).rename(partial / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final_names[v] for k, v in sorted(weight_map.items())}}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    assets = Path(ckpt) / checkpoint.HF_ASSETS
    copied = checkpoint.copy_assets(assets, partial) if assets.exists() else []
    # config.json (and a reward model's tokenizer edits) are the caller's (`convert.write_hf_config`): they need
    # transformers, whose import is ~2.5 s of a fresh process and usually already done in the caller
    return {"shards": len(files), "tensors": len(weight_map), "bytes": total, "assets": copied}


def reshard(src: Path, out: Path, parallel: ParallelConfig, device) -> dict[str, Any]:
    """Load `src` at this launch's layout and save it from there with Megatron-Core's own save."""
    from pai_cookbook.workers.models import build_model

    model, dtype = checkpoint.read_config(src)
    chunks = build_model(model, parallel, PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype]), device, 0,
                         head=checkpoint.head(src), initialize=False)
    checkpoint.load(chunks, src)
    saved_at = layout.record(parallel, torch.distributed.get_world_size())
    checkpoint.save(chunks, out, model, dtype, assets=src / checkpoint.HF_ASSETS, resharded_from=str(src),
                    saved_at=saved_at)
    return {"saved_at": saved_at}


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started (or since `reset_peak_rss`), in MiB.

    Linux's VmHWM, the high-water mark of this program's own memory: `getrusage`'s ru_maxrss survives exec, so
    a worker forked from a large launcher (a notebook kernel holding a model) would report the launcher's
    size (measured: 1,948 MB for a conversion whose own peak was ~860 MB).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, bytes on macOS: a bound


def reset_peak_rss() -> bool:
    """Start `peak_rss_mb` afresh from the current RSS (Linux: "5" to /proc/self/clear_refs), so a conversion run
    in a caller's process reports its own peak, not the caller's earlier one. False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def run(job: ConvertJob, device) -> dict[str, Any]:
    """One conversion, in a process whose group and parallel state are up: a worker's (`main`), or for the
    streaming directions the caller's own world of one (`convert._write`, `launch.run_here`)."""
    import psutil

    rss_before_mb = psutil.Process().memory_info().rss / 2**20  # torch + Megatron-Core imported, nothing loaded
    own_peak = reset_peak_rss()
    start = time.perf_counter()
    src, dst = Path(job.src), Path(job.dst)
    if job.direction == "hf2mcore":
        result = write_megatron(inspect_hf(src, job.model, drop_mtp=job.drop_mtp), dst)
    elif job.direction == "mcore2hf":
        result = write_hf(src, dst, job.max_shard_bytes)
    elif job.direction == "lora_merge":
        result = adapters.merge(src, dst, job.parallel, device)
    elif job.direction == "lora_peft":
        result = adapters.export_peft(src, dst, device)
    else:
        result = reshard(src, dst, job.parallel, device)
    return result | {"seconds": time.perf_counter() - start, "rss_before_mb": rss_before_mb,
                     "peak_rss_mb": peak_rss_mb() if own_peak else None}


@worker.entry(ConvertJob)
def main(job: ConvertJob) -> dict[str, Any]:
    with worker.session(job.parallel, seed=0) as device:
        return run(job, device)


if __name__ == "__main__":
    main()
