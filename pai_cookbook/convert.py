"""Checkpoint conversion: Hugging Face safetensors <-> Megatron-Core distributed checkpoint (torch_dist).

    convert.hf_to_megatron("Meta-Llama-3-8B", "ckpt/llama3-mcore")    # loadable at any TP/PP/EP
    convert.megatron_to_hf("ckpt/llama3-mcore", "hf/llama3-trained")  # AutoModelForCausalLM-loadable

Both directions stream, so memory does not grow with the model:
- HF -> Megatron writes PyTorch Distributed Checkpoint (DCP) files itself, with the chunk layout
  Megatron-Core's own save would produce (taken from a model built on the meta device, so it costs no
  memory). Each chunk (one layer's tensor, one expert) is read from its safetensors shard, converted
  (`hf_mapping`) and written just before it is needed, then dropped.
- Megatron -> HF loads the checkpoint a layer at a time with Megatron-Core's own `dist_checkpointing.load`
  (which reads only the requested chunks) and writes safetensors shards as they fill up.
A torch_dist checkpoint holds whole tensors as chunks and Megatron-Core reshards on load, so one
converted checkpoint serves every TP/PP/EP layout that divides the model.

Everything checkable is checked before any worker starts (`inspect_hf`): architecture, missing or
truncated shards, every tensor's presence and shape. Output goes to `<out>.partial` and is renamed
into place only when complete: a crash never leaves a folder a later load would accept.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pai_cookbook import checkpoint, families, hf_mapping
from pai_cookbook.config import ConfigError, ModelConfig, ParallelConfig

IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; recomputed on load
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default shard size: 5 GB


# --------------------------------------------------------------------------------------------------
# Inspection: everything that can be known before a worker starts
# --------------------------------------------------------------------------------------------------
@dataclass
class HFCheckpoint:
    folder: Path
    model: ModelConfig
    tensors: dict[str, tuple[str, tuple[int, ...], str]]
    """name -> (shard file, shape, safetensors dtype)."""

    @property
    def dtype(self) -> torch.dtype:
        names = {dtype for _, _, dtype in self.tensors.values()}
        if len(names) != 1 or next(iter(names)) not in _DTYPES:
            raise ConfigError(f"{self.folder}: tensors must share one dtype of {sorted(_DTYPES)}, found {sorted(names)}.")
        return _DTYPES[names.pop()]

    @property
    def largest_shard_bytes(self) -> int:
        return max((self.folder / f).stat().st_size for f in {f for f, _, _ in self.tensors.values()})


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file, after checking the file holds all the data it declares."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError(f"{path} is truncated ({size} bytes): not even a safetensors header.")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise ConfigError(f"{path} is truncated: header of {header_len} bytes, file of {size}.")
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ConfigError(f"{path} is truncated: its tensors need {8 + header_len + end} bytes, the file has "
                          f"{size}. Download it again.")
    return header


def inspect_hf(folder: str | Path) -> HFCheckpoint:
    """Read config and safetensors headers (no weights) and check them against each other.

    Raises:
        ConfigError: unsupported architecture, truncated shard, missing/unexpected tensor, shape mismatch.
        FileNotFoundError: no config.json, no safetensors, or a shard the index lists is absent.
    """
    folder = Path(folder)
    model = families.from_hf(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in folder.glob("*.bin")) or "nothing"
        raise FileNotFoundError(f"{folder} has no model.safetensors(.index.json) (found {found}). The cookbook "
                                f"reads safetensors only (pickle .bin files can run code); re-save the model "
                                f"with save_pretrained(folder, safe_serialization=True).")
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(f"shard {name} listed in {index.name} is missing from {folder}.")
        for key, meta in read_safetensors_header(path).items():
            if key != "__metadata__":
                tensors[key] = (name, tuple(meta["shape"]), meta["dtype"])
    expected = hf_mapping.expected_hf_shapes(model)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(f"{folder}: {len(missing)} tensor(s) that config.json implies are missing, e.g. "
                          f"{missing[:3]}; the weights do not belong to this config.")
    unexpected = sorted(k for k in set(tensors) - set(expected) if not k.endswith(IGNORED_HF_TENSORS))
    if unexpected:
        raise ConfigError(f"{folder}: tensor(s) the cookbook's {model.family} mapping does not know, e.g. "
                          f"{unexpected[:3]}; the checkpoint has a feature the converter does not cover.")
    for key, shape in expected.items():
        if tensors[key][1] != shape:
            raise ConfigError(f"{folder}: tensor {key} has shape {list(tensors[key][1])}, but config.json "
                              f"implies {list(shape)}; config and weights disagree.")
    checked = HFCheckpoint(folder, model, {k: tensors[k] for k in expected})
    checked.dtype  # one dtype for all tensors, or a ConfigError now rather than in the worker
    return checked


def check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Check that a layout divides the model (heads, KV groups, layers, experts) before converting."""
    from pai_cookbook.config import DataConfig, RunConfig

    world = layout_world_size(parallel)
    dp, pp = world // parallel.model_parallel_size, parallel.pipeline_model_parallel_size
    seq = min(128, model.max_position_embeddings, model.sliding_window or 128)
    RunConfig(model=model, parallel=parallel,
              data=DataConfig(seq_length=seq, micro_batch_size=1, global_batch_size=dp * pp)).validate(world)








# --------------------------------------------------------------------------------------------------
# Worker side: meta model, lazy DCP writer, layer-by-layer reader
# --------------------------------------------------------------------------------------------------
def meta_model(model: ModelConfig, dtype: torch.dtype):
    """The TP=1/PP=1 GPTModel on the meta device: every name, shape and chunk layout, no memory."""
    from pai_cookbook.config import PrecisionConfig
    from pai_cookbook.model import build_model
    from pai_cookbook.runtime import detect_device

    precision = PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype])
    with torch.device("meta"):
        (gpt,) = build_model(model, ParallelConfig(), precision, detect_device(), seed=0)
    return gpt


class _HFReader:
    """Reads HF tensors one at a time (the shard is opened per read: resident memory stays one tensor)."""

    def __init__(self, source: HFCheckpoint):
        self.source = source

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.source.folder / self.source.tensors[name][0], framework="pt") as f:
            return f.get_tensor(name)


@dataclass(frozen=True)
class Chunk:
    """One stored piece of one Megatron parameter, as Megatron-Core's own save would lay it out."""

    param: str
    """Megatron parameter name (TP=1)."""
    key: str
    """Checkpoint key; layers (and experts) are stacked along leading axes of one tensor."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    """Where the chunk sits in the stacked global tensor."""
    view: tuple[tuple[int, ...], tuple[int, ...], int]
    """(size, stride, storage offset) of the chunk inside the parameter (SwiGLU fc1 has two chunks)."""


def chunk_layout(model: ModelConfig, dtype: torch.dtype) -> tuple[list[Chunk], dict[str, Any]]:
    """Every chunk of the checkpoint of `model`, and the PyTorch-DCP state dict that describes them.

    Taken from a meta-device model's `sharded_state_dict()` with factories applied, so keys, stacking
    and the SwiGLU gate/up split are exactly Megatron-Core's.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    state = meta_model(model, dtype).sharded_state_dict()
    apply_factories(state)
    chunks = []
    for param, value in state.items():
        for sh in nested_values({param: value}):
            if isinstance(sh, ShardedTensor):
                sizes = (1,) * sh.prepend_axis_num + tuple(sh.data.shape)
                chunks.append(Chunk(param, sh.key, tuple(sh.global_offset), sizes,
                                    (tuple(sh.data.size()), tuple(sh.data.stride()), sh.data.storage_offset())))
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(state)
    return chunks, mcore_to_pyt_state_dict(sharded, is_loading=False)


def _lazy_planner(model: ModelConfig, read: _HFReader, chunks: list[Chunk], padded_vocab: int):
    """A Megatron-Core save planner whose tensor data is built from HF tensors when DCP writes it."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    by_index = {(c.key, c.offsets): c for c in chunks}
    pending: dict[str, int] = {}
    for c in chunks:
        pending[c.param] = pending.get(c.param, 0) + 1

    class LazyPlanner(MCoreSavePlanner):
        # Parameters being written; one is dropped as soon as its last chunk (fc1 has two) is written,
        # so the working set is about one parameter whatever order DCP writes in.
        live: dict[str, torch.Tensor] = {}

        def param(self, name: str) -> torch.Tensor:
            if name not in self.live:
                kind, hf_names = hf_mapping.hf_names(name, model)
                self.live[name] = hf_mapping.to_megatron(kind, [read(n) for n in hf_names], model, padded_vocab)
            return self.live[name]

        def resolve_data(self, write_item):
            chunk = by_index.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
            if chunk is None:  # bytes (extra state): real, tiny, already in the state dict
                return super().resolve_data(write_item)
            data = self.param(chunk.param).as_strided(*chunk.view).reshape(chunk.sizes).contiguous()
            pending[chunk.param] -= 1
            if pending[chunk.param] == 0:
                del self.live[chunk.param]
            return data

    return LazyPlanner(flatten_state_dict=False, can_run_decentralized_global_plan=False)


def write_megatron(source: HFCheckpoint, partial: Path) -> dict[str, Any]:
    """Stream `source` into a torch_dist checkpoint in `partial` (runs in a 1-process worker)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint import FileSystemWriter, save

    model, dtype = source.model, source.dtype
    chunks, pyt_state = chunk_layout(model, dtype)
    planner = _lazy_planner(model, _HFReader(source), chunks, model.padded_vocab_size(1))
    save(pyt_state, storage_writer=FileSystemWriter(partial, single_file_per_rank=True, thread_count=1),
         planner=planner)
    torch.save({}, partial / "common.pt")  # a model-only checkpoint has no common (non-sharded) state
    save_config(CheckpointingConfig(sharded_backend="torch_dist", sharded_backend_version=1), str(partial))
    checkpoint.write_config(partial, model, dtype, source=str(source.folder))
    checkpoint.copy_assets(source.folder, partial / checkpoint.HF_ASSETS)
    return {"chunks": len(chunks), "dtype": checkpoint.DTYPE_NAMES[dtype]}






def _region_planner(regions: dict[str, tuple[str, tuple[int, ...]]]):
    """A DCP load planner that reads given regions of stored tensors into the state dict's tensors.

    regions: state-dict key -> (checkpoint key, offsets of the region); the region's size is the tensor's.
    """
    import dataclasses as dc

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for name, tensor in self.state_dict.items():
                key, offsets = regions[name]
                wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
                for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [wanted]):
                    dest = MetadataIndex(name, item.dest_index.offset, item.dest_index.index)
                    items.append(dc.replace(item, dest_index=dest))
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            # dest_offsets are relative to the requested region, i.e. to our tensor.
            target = self.state_dict[read_item.dest_index.fqn]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                target = target.narrow(dim, start, length)
            return target

    return RegionPlanner()


def iter_megatron_params(ckpt: Path, model: ModelConfig, dtype: torch.dtype):
    """Yield (Megatron name, whole tensor) from a torch_dist checkpoint, one parameter in memory at a time.

    Each parameter's chunks are read as regions of the stacked tensors (only those bytes are read) and
    placed by the same view geometry the writer used: the exact inverse of `write_megatron`.
    """
    from torch.distributed.checkpoint import FileSystemReader, load

    chunks, _ = chunk_layout(model, dtype)
    shapes = dict((name, p.shape) for name, p in meta_model(model, dtype).named_parameters())
    by_param: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_param.setdefault(chunk.param, []).append(chunk)
    for name, param_chunks in by_param.items():
        full = torch.empty(shapes[name], dtype=dtype)
        state = {f"chunk{i}": torch.empty(c.sizes, dtype=dtype) for i, c in enumerate(param_chunks)}
        regions = {f"chunk{i}": (c.key, c.offsets) for i, c in enumerate(param_chunks)}
        load(state, storage_reader=FileSystemReader(str(ckpt)), planner=_region_planner(regions))
        for i, c in enumerate(param_chunks):
            full.as_strided(*c.view).copy_(state.pop(f"chunk{i}").reshape(c.view[0]))
        yield name, full


def write_hf(ckpt: Path, partial: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Export a torch_dist checkpoint to HF safetensors shards + index in `partial` (1-process worker)."""
    from safetensors.torch import save_file

    model, dtype = checkpoint.read_config(ckpt)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes, files, weight_map, total = 0, [], {}, 0

    def flush() -> None:
        nonlocal shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"  # renamed to -of-N below, once N is known
        save_file(shards[-1], partial / name, metadata={"format": "pt"})
        files.append(name)
        shards[-1], shard_bytes = {}, 0

    for name, tensor in iter_megatron_params(ckpt, model, dtype):
        kind, hf_names = hf_mapping.hf_names(name, model)
        for hf_name, hf_tensor in zip(hf_names, hf_mapping.to_hf(kind, tensor, model)):
            size = hf_tensor.numel() * hf_tensor.element_size()
            if shard_bytes and shard_bytes + size > max_shard_bytes:
                flush()
            shards[-1][hf_name] = hf_tensor.contiguous()
            shard_bytes += size
            total += size
            weight_map[hf_name] = len(files)
    if shards[-1]:
        flush()
    final_names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for old, new in zip(files, final_names):
        (partial / old).rename(partial / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final_names[v] for k, v in sorted(weight_map.items())}}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    assets = Path(ckpt) / checkpoint.HF_ASSETS
    copied = checkpoint.copy_assets(assets, partial) if assets.exists() else []
    source_config = assets / "config.json"
    config = families.to_hf(model, json.loads(source_config.read_text()) if source_config.exists() else None)
    config.dtype = dtype
    config.save_pretrained(partial)  # written after the assets: the config is the checkpoint's own
    return {"shards": len(files), "tensors": len(weight_map), "bytes": total, "assets": copied}


def compare_hf_checkpoints(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Tensor-by-tensor bitwise comparison of two HF folders (one tensor pair in memory at a time)."""
    from safetensors import safe_open

    left, right = inspect_hf(a), inspect_hf(b)
    different = sorted(set(left.tensors) ^ set(right.tensors))
    for name in sorted(set(left.tensors) & set(right.tensors)):
        with safe_open(left.folder / left.tensors[name][0], "pt") as f, \
                safe_open(right.folder / right.tensors[name][0], "pt") as g:
            x, y = f.get_tensor(name), g.get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            different.append(name)
    return {"tensors": len(left.tensors), "bitwise_identical": not different, "different": different}


# --------------------------------------------------------------------------------------------------
# Notebook / script API and the worker entry
# --------------------------------------------------------------------------------------------------
def hf_to_megatron(hf_dir: str | Path, out: str | Path, *, parallel: ParallelConfig | None = None,
                   overwrite: bool = False, run_dir: str | Path | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """Convert a Hugging Face model folder into a Megatron-Core torch_dist checkpoint at `out`.

    Args:
        hf_dir: folder with config.json, safetensors shard(s) (+ index) and tokenizer files.
        out: checkpoint folder to create; loadable at any TP/PP/EP that divides the model.
        parallel: the layout you will load it at; checked against the model before converting.
        overwrite: replace an existing `out` instead of refusing.
        timeout_s: stop the conversion (and leave `out` untouched) after this many seconds.
    Returns:
        Worker figures: tensors written, dtype, seconds, peak RSS.
    """
    from pai_cookbook import launch

    source = inspect_hf(hf_dir)
    if parallel is not None:
        check_layout(source.model, parallel)
    out = Path(out)
    partial = checkpoint.prepare(out, overwrite)
    result = launch.launch("pai_cookbook.convert", args=["worker", "hf2mcore", str(Path(hf_dir).resolve()),
                                                         str(partial)],
                           run_dir=run_dir or out.with_name(out.name + ".logs"), echo=False, show_progress=False,
                           timeout_s=timeout_s)
    checkpoint.publish(partial, out)
    return {k: v for k, v in result.items() if k != "events"}


def megatron_to_hf(ckpt: str | Path, out: str | Path, *, overwrite: bool = False,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Export a cookbook Megatron checkpoint to a Hugging Face folder (safetensors shards, config, tokenizer)."""
    from pai_cookbook import launch

    checkpoint.read_config(ckpt)  # fails early on a folder that is not a cookbook checkpoint
    out = Path(out)
    partial = checkpoint.prepare(out, overwrite)
    result = launch.launch("pai_cookbook.convert", args=["worker", "mcore2hf", str(Path(ckpt).resolve()), str(partial),
                                                         str(max_shard_bytes)],
                           run_dir=run_dir or out.with_name(out.name + ".logs"), echo=False, show_progress=False)
    checkpoint.publish(partial, out)
    return {k: v for k, v in result.items() if k != "events"}


def layout_world_size(parallel: ParallelConfig) -> int:
    """The smallest number of processes that holds a layout: PP x lcm(TP, EP x expert-TP)."""
    return parallel.pipeline_model_parallel_size * math.lcm(parallel.tensor_model_parallel_size,
                                                             parallel.expert_model_parallel_size * parallel.expert_tp)


def reshard(ckpt: str | Path, out: str | Path, parallel: ParallelConfig, *, overwrite: bool = False,
            run_dir: str | Path | None = None) -> dict[str, Any]:
    """Load `ckpt` at layout `parallel` and save it from there with Megatron-Core's own save.

    A torch_dist checkpoint loads at any layout anyway; this writes one *saved at* that layout (as a
    training run at that layout would), which is how a resharding round trip is demonstrated.
    """
    from pai_cookbook import launch

    model, _ = checkpoint.read_config(ckpt)
    check_layout(model, parallel)
    checkpoint.check_writable(out, overwrite)
    sizes = [parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
             parallel.expert_model_parallel_size, parallel.expert_tp]
    result = launch.launch("pai_cookbook.convert", nproc_per_node=layout_world_size(parallel),
                           args=["worker", "reshard", str(Path(ckpt).resolve()), str(Path(out).resolve()),
                                 *map(str, sizes)],
                           run_dir=run_dir or Path(out).with_name(Path(out).name + ".logs"), echo=False,
                           show_progress=False)
    return {k: v for k, v in result.items() if k != "events"}


def _reshard_worker(src: Path, out: Path, tp: str, pp: str, ep: str, etp: str) -> dict[str, Any]:
    from pai_cookbook.config import PrecisionConfig
    from pai_cookbook.model import build_model
    from pai_cookbook.runtime import detect_device

    parallel = ParallelConfig(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp),
                              expert_model_parallel_size=int(ep), expert_tensor_parallel_size=int(etp))
    model, dtype = checkpoint.read_config(src)
    chunks = build_model(model, parallel, PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype]), detect_device(), 0)
    checkpoint.load(chunks, src)
    checkpoint.save(chunks, out, model, dtype, assets=src / checkpoint.HF_ASSETS, resharded_from=str(src),
                    saved_at={"tp": int(tp), "pp": int(pp), "ep": int(ep), "etp": int(etp)})
    return {"saved_at": {"tp": int(tp), "pp": int(pp), "ep": int(ep)}}


def _worker(_marker: str, direction: str, src: str, dst: str, *extra: str) -> dict[str, Any]:
    import resource
    import time

    from pai_cookbook import runtime

    parallel = ParallelConfig()
    if direction == "reshard":
        tp, pp, ep, etp = (int(x) for x in extra)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    runtime.init_distributed(parallel, seed=0)
    import psutil

    rss_before_mb = psutil.Process().memory_info().rss / 2**20  # torch + Megatron-Core imported, nothing loaded
    try:
        start = time.perf_counter()
        if direction == "hf2mcore":
            result = write_megatron(inspect_hf(src), Path(dst))
        elif direction == "mcore2hf":
            result = write_hf(Path(src), Path(dst), *(int(x) for x in extra))
        else:
            result = _reshard_worker(Path(src), Path(dst), *extra)
        # ru_maxrss is in KiB on Linux
        return result | {"seconds": time.perf_counter() - start, "rss_before_mb": rss_before_mb,
                         "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    finally:
        runtime.destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m pai_cookbook.convert {hf2mcore,mcore2hf} SRC OUT [--tp N --pp N --ep N] [--overwrite]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        from pai_cookbook import worker

        worker.entry(_worker)()
        return 0
    parser = argparse.ArgumentParser(prog="python -m pai_cookbook.convert", description=__doc__.splitlines()[0])
    parser.add_argument("direction", choices=["hf2mcore", "mcore2hf"])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1, help="layout to check the model against (hf2mcore)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    opts = parser.parse_args(argv)
    try:
        if opts.direction == "hf2mcore":
            parallel = ParallelConfig(tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
                                      expert_model_parallel_size=opts.ep)
            result = hf_to_megatron(opts.src, opts.out, parallel=parallel, overwrite=opts.overwrite)
        else:
            result = megatron_to_hf(opts.src, opts.out, overwrite=opts.overwrite)
    except (ConfigError, FileNotFoundError, FileExistsError) as err:
        print(f"pai_cookbook.convert: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
