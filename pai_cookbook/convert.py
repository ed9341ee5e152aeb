"""Checkpoint conversion: Hugging Face safetensors <-> Megatron-Core distributed checkpoint (torch_dist).

    convert.hf_to_megatron("Meta-Llama-3-8B", "ckpt/llama3-mcore")    # loadable at any TP/PP/EP
    convert.megatron_to_hf("ckpt/llama3-mcore", "hf/llama3-trained")  # AutoModelForCausalLM-loadable

Both directions stream, so memory does not grow with the model:
- HF -> Megatron writes PyTorch Distributed Checkpoint (DCP) files itself, with the chunk layout
  Megatron-Core's own save would produce (taken from a model built on the meta device, so it costs no
  memory). Each chunk (one layer's tensor, one expert) is read from its safetensors shard, converted
  (`hf_mapping`) and written just before it is needed, then dropped.
- Megatron -> HF reads the checkpoint one parameter at a time (a DCP load of only that parameter's chunks)
  and writes safetensors shards as they fill up; this process then writes config.json (`write_hf_config`).
A torch_dist checkpoint holds whole tensors as chunks and Megatron-Core reshards on load, so one
converted checkpoint serves every TP/PP/EP layout that divides the model.

Everything checkable is checked before any worker starts (`inspect_hf`): architecture, missing or
truncated shards, every tensor's presence and shape. Output goes to `<out>.partial` and is renamed
into place only when complete: a crash never leaves a folder a later load would accept.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint, families
from pai_cookbook.core.checkpoints.hf_checkpoint import IGNORED_HF_TENSORS, HFCheckpoint, inspect_hf, read_safetensors_header
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig
from pai_cookbook.core.launching import cli, nodes
from pai_cookbook.core.launching.jobs import DEFAULT_SHARD_BYTES, DIRECTIONS, ConvertJob
from pai_cookbook.core.text import tokenizer

__all__ = ["DEFAULT_SHARD_BYTES", "DIRECTIONS", "IGNORED_HF_TENSORS", "ConvertJob", "HFCheckpoint", "compare_hf_checkpoints",
           "hf_to_megatron", "inspect_hf", "main", "megatron_to_hf", "read_safetensors_header", "reshard", "reward_hf_config",
           "reward_padding", "write_hf_config"]


def compare_hf_checkpoints(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Tensor-by-tensor bitwise comparison of two HF folders (one tensor pair in memory at a time), by the names the
    conversion reads them under (a multimodal model's language model as the text model's; GPT-OSS's MXFP4 experts as
    their blocks and scales, which an unquantized folder does not have: listed as different)."""
    from safetensors import safe_open

    left, right = inspect_hf(a), inspect_hf(b)
    different = sorted(set(left.tensors) ^ set(right.tensors))
    for name in sorted(set(left.tensors) & set(right.tensors)):
        with safe_open(left.folder / left.tensors[name][0], "pt") as f, \
                safe_open(right.folder / right.tensors[name][0], "pt") as g:
            x, y = f.get_tensor(left.stored.get(name, name)), g.get_tensor(right.stored.get(name, name))
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            different.append(name)
    return {"tensors": len(left.tensors), "bitwise_identical": not different, "different": different}



# --------------------------------------------------------------------------------------------------
# Notebook / script API and the worker entry
# --------------------------------------------------------------------------------------------------
@nodes.node0_only
def hf_to_megatron(hf_dir: str | Path, out: str | Path, *, parallel: ParallelConfig | None = None,
                   overwrite: bool = False, require_tokenizer: bool = True, run_dir: str | Path | None = None,
                   timeout_s: float | None = None, drop_mtp: bool = False) -> dict[str, Any]:
    """Convert a Hugging Face model folder into a Megatron-Core torch_dist checkpoint at `out`.

    Args:
        hf_dir: folder with config.json, safetensors shard(s) (+ index) and tokenizer files.
        out: checkpoint folder to create; loadable at any TP/PP/EP that divides the model.
        parallel: the layout you will load it at; checked against the model before converting.
        overwrite: replace an existing `out` instead of refusing.
        require_tokenizer: refuse a folder without tokenizer files (its checkpoint could neither
            generate nor tokenize data); False converts the weights alone.
        timeout_s: stop the conversion (and leave `out` untouched) after this many seconds.
        drop_mtp: convert a checkpoint that carries multi-token-prediction layers (DeepSeek-V3, GLM-4.5) without them;
            by default such a checkpoint is refused, naming them.
    Returns:
        Worker figures: tensors written, dtype, seconds, peak RSS.
    """
    source = inspect_hf(hf_dir, drop_mtp=drop_mtp)
    if require_tokenizer and not tokenizer.has_tokenizer(source.folder):
        raise ConfigError(f"{source.folder} has no tokenizer files (one of {list(tokenizer.VOCABULARY_FILES)}): a "
                          f"checkpoint converted from it could neither generate nor prepare data. Copy the model's "
                          f"tokenizer files into the folder, or pass require_tokenizer=False to convert the weights alone.")
    layout.check(source.model, parallel or ParallelConfig(), purpose="load")
    job = ConvertJob(direction="hf2mcore", src=str(source.folder.resolve()), dst="", model=source.model,
                     drop_mtp=drop_mtp)
    return _write(job, Path(out), overwrite, run_dir, timeout_s)


@nodes.node0_only
def megatron_to_hf(ckpt: str | Path, out: str | Path, *, overwrite: bool = False,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Export a cookbook Megatron checkpoint to a Hugging Face folder (safetensors shards, config, tokenizer)."""
    ckpt = checkpoint.resolve(ckpt)  # a save folder's latest iteration; fails early on a folder that is neither
    if checkpoint.head(ckpt) == "reward":  # its padding token, before any tensor is converted
        assets = Path(ckpt) / checkpoint.HF_ASSETS
        reward_padding(tokenizer.load(assets), assets)
    job = ConvertJob(direction="mcore2hf", src=str(Path(ckpt).resolve()), dst="", max_shard_bytes=max_shard_bytes)
    return _write(job, Path(out), overwrite, run_dir, None, finish=lambda partial: write_hf_config(Path(ckpt), partial))


def write_hf_config(ckpt: Path, folder: Path) -> None:
    """config.json of an export (after the worker copied the tokenizer assets: the config is the checkpoint's
    own); a reward model as a one-label `...ForSequenceClassification` (`reward_hf_config`). Run in the caller's
    process, where transformers is usually imported already, not in the worker (~2.5 s of its start)."""
    model, dtype = checkpoint.read_config(ckpt)
    source_config = Path(ckpt) / checkpoint.HF_ASSETS / "config.json"
    config = families.to_hf(model, json.loads(source_config.read_text()) if source_config.exists() else None)
    config.dtype = dtype
    if checkpoint.head(ckpt) == "reward":
        reward_hf_config(config, folder)
    config.save_pretrained(folder)


def reward_hf_config(config, folder: Path) -> None:
    """Make `config` a one-label `...ForSequenceClassification`, and its tokenizer pad with a token that never
    ends a sequence: transformers reads the score at each row's last token that is not `pad_token_id`, and the
    cookbook's reward is read at the end-of-turn token, which many chat tokenizers also pad with."""
    config.architectures = [name.replace("ForCausalLM", "ForSequenceClassification") for name in config.architectures]
    config.num_labels, config.tie_word_embeddings = 1, False
    hf = tokenizer.load(folder)
    text, pad = reward_padding(hf, folder)
    if pad != hf.pad_token_id:
        hf.pad_token = text
        hf.save_pretrained(folder)
    config.pad_token_id = pad


def reward_padding(hf, folder: Path) -> tuple[str, int]:
    """The token an exported reward model pads with: a special token that is not an end token (transformers scores a
    row at its rightmost token that is not padding, and every sequence the cookbook scores ends with its end token):
    the tokenizer's pad, unknown or begin token first, then any other special token. An ordinary token will not do:
    named as the pad token it becomes special, and text holding it would tokenize differently.

    Raises:
        ConfigError: a tokenizer whose only special tokens are end tokens (GPT-2's layout), before any work.
    """
    ends = set(tokenizer.eos_ids(folder, hf)) | {hf.eos_token_id} - {None}  # the generation config's and its own
    named = [(hf.pad_token, hf.pad_token_id), (hf.unk_token, hf.unk_token_id), (hf.bos_token, hf.bos_token_id)]
    for text, i in [*named, *zip(hf.all_special_tokens, hf.all_special_ids)]:
        if text is not None and i is not None and i not in ends:
            return text, i
    raise ConfigError(f"the reward model's tokenizer has no special token but its end token(s) {sorted(ends)}: an "
                      f"exported ...ForSequenceClassification reads the score at the last token that is not padding, "
                      f"so it needs a padding token other than the end. Give the base model's tokenizer one before "
                      f"training the reward model (tokenizer.add_special_tokens({{'pad_token': '<|pad|>'}}), then "
                      f"extend.grow the checkpoint to the new size); the Megatron-Core checkpoint itself scores as it "
                      f"is (rlhf uses it directly).")


def _write(job: ConvertJob, out: Path, overwrite: bool, run_dir: str | Path | None,
           timeout_s: float | None, finish: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Run a streaming conversion into `<out>.partial` (then `finish(partial)` in this process, if given),
    published as `out` only when complete.

    Where this process can host a world of one (no CUDA, no process group of its own) and no timeout is asked
    for, the conversion runs here: a worker process would spend ~3 s importing torch and Megatron-Core before
    its first byte, more than the bytes of a small model take. Otherwise (GPU machines, `timeout_s`, a caller
    that is itself a worker) it is a one-process worker, with its log in `run_dir`."""
    from pai_cookbook.core.launching import launch
    from pai_cookbook.core.machine import runtime

    with checkpoint.writing(out, overwrite) as partial:
        job.dst = str(partial.resolve())
        with checkpoint.full_disk_said(partial, then=f"nothing of {out.name} is left half-written"):
            if timeout_s is None and runtime.can_host_world_of_one():
                result = launch.run_here(job)
            else:
                result = launch.launch(job, run_dir=run_dir or out.with_name(out.name + ".logs"), echo=False,
                                       show_progress=False, timeout_s=timeout_s)
            if finish is not None:
                finish(partial)
    return {k: v for k, v in result.items() if k != "events"}


@nodes.node0_only
def reshard(ckpt: str | Path, out: str | Path, parallel: ParallelConfig, *, overwrite: bool = False,
            run_dir: str | Path | None = None) -> dict[str, Any]:
    """Load `ckpt` at layout `parallel` and save it from there with Megatron-Core's own save.

    A torch_dist checkpoint loads at any layout anyway; this writes one *saved at* that layout (as a
    training run at that layout would), which is how a resharding round trip is demonstrated.
    """
    from pai_cookbook.core.launching import launch

    ckpt = checkpoint.resolve(ckpt)
    model, _ = checkpoint.read_config(ckpt)
    layout.check(model, parallel, purpose="load")
    checkpoint.check_writable(out, overwrite)
    job = ConvertJob(direction="reshard", src=str(Path(ckpt).resolve()), dst=str(Path(out).resolve()), parallel=parallel)
    with checkpoint.worker_writes(out):
        result = launch.launch(job, nproc_per_node=job.processes(),
                               run_dir=run_dir or Path(out).with_name(Path(out).name + ".logs"), echo=False,
                               show_progress=False)
    return {k: v for k, v in result.items() if k != "events"}


def main(argv: list[str] | None = None) -> int:
    """CLI: `python -m pai_cookbook.convert {hf2mcore,mcore2hf} SRC OUT [--tp N --pp N --ep N] [--overwrite]`."""
    parser = argparse.ArgumentParser(prog="python -m pai_cookbook.convert", description=__doc__.splitlines()[0])
    parser.add_argument("direction", choices=["hf2mcore", "mcore2hf"])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, default=1, help="layout to check the model against (hf2mcore)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    opts = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        if opts.direction == "mcore2hf":
            return megatron_to_hf(opts.src, opts.out, overwrite=opts.overwrite)
        parallel = ParallelConfig(tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
                                  expert_model_parallel_size=opts.ep)
        return hf_to_megatron(opts.src, opts.out, parallel=parallel, overwrite=opts.overwrite)
    return cli.finish("pai_cookbook.convert", work)


if __name__ == "__main__":
    sys.exit(main())
