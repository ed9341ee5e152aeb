"""What a cookbook checkpoint says of itself: its `pai_cookbook.json` (the model, the dtype, where it came from, the
run that saved it), read without torch_dist, Megatron-Core or the rest of `core.checkpoints.checkpoint` (so
`core.configs.config` can start a run from a checkpoint: `RunConfig.from_checkpoint`). `core.checkpoints.checkpoint`
re-exports every name here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.core.launching import inputs

CONFIG_FILE = "pai_cookbook.json"
PARTIAL_SUFFIX = ".partial"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
ITER_PREFIX = "iter_"


def partial_dir(out: str | Path) -> Path:
    """`<out>.partial`, where a writer fills `out` before renaming it into place."""
    out = Path(out)
    return out.with_name(out.name + PARTIAL_SUFFIX)


def finished_iterations(save_dir: str | Path) -> list[Path]:
    """Complete training checkpoints in save_dir, oldest first (.partial folders are never listed)."""
    folder = Path(save_dir)
    if not folder.is_dir():
        return []
    done = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(ITER_PREFIX)
            and p.name[len(ITER_PREFIX):].isdigit() and (p / CONFIG_FILE).exists()]
    return sorted(done, key=lambda p: int(p.name[len(ITER_PREFIX):]))


def resolve(ckpt: str | Path) -> Path:
    """The checkpoint a path names, the one rule every entry point that takes a checkpoint follows: the folder itself
    where it is a cookbook checkpoint (it holds `pai_cookbook.json`), else a training run's save folder's latest
    finished `iter_*` (what `train.run`, `dpo.train` and the RL runs leave). An entry point resolves once and hands
    the resolved folder on, so a run that finishes another iteration meanwhile cannot mix two of them.

    Raises:
        FileNotFoundError: neither, naming what the folder holds instead.
    """
    folder = Path(ckpt)
    partial = folder.name.endswith(PARTIAL_SUFFIX)  # written into, then renamed: never loadable, whatever it holds
    if (folder / CONFIG_FILE).exists() and not partial:
        return folder
    latest = [] if partial else finished_iterations(folder)
    if latest:
        return latest[-1]
    if partial:
        found = "a .partial folder is an unfinished write"
    elif not folder.exists():
        found = "it does not exist"
    elif folder.is_dir():
        unfinished = sorted(p.name for p in folder.glob(f"{ITER_PREFIX}*"))
        found = (f"it holds no finished iteration ({', '.join(unfinished[:3])} "
                 f"{'are' if len(unfinished) > 1 else 'is'} unfinished)" if unfinished else "it holds no iter_* folder")
    else:
        found = "it is a file"
    raise FileNotFoundError(f"{ckpt} has no {CONFIG_FILE}: not a checkpoint written by the cookbook, nor a training "
                            f"save folder with a finished {ITER_PREFIX}* checkpoint ({found}). Give a checkpoint that "
                            f"convert.hf_to_megatron wrote, or the save_dir of a finished train.run.")


def read_config(ckpt: str | Path) -> tuple[ModelConfig, torch.dtype]:
    """The ModelConfig and dtype a cookbook checkpoint describes itself with."""
    path = Path(ckpt) / CONFIG_FILE
    if not path.exists():
        hint = " (a .partial folder is an unfinished write)" if str(ckpt).endswith(PARTIAL_SUFFIX) else ""
        raise FileNotFoundError(f"{ckpt} has no {CONFIG_FILE}: not a checkpoint written by the cookbook"
                                f"{hint}; convert.hf_to_megatron and train.run write them.")
    data = description(ckpt)
    return ModelConfig(**data["model"]), {v: k for k, v in DTYPE_NAMES.items()}[data["dtype"]]


def description(ckpt: str | Path) -> dict[str, Any]:
    """The checkpoint's `pai_cookbook.json` (model, dtype, provenance, the run that saved it)."""
    return inputs.read_json(Path(ckpt) / CONFIG_FILE, what="checkpoint description",
                            fix="Its checkpoint cannot be used: convert or train it again, or use an earlier one.")


def identity(ckpt: str | Path) -> str:
    """A short name for a checkpoint's contents: a hash of its description (which names the write that made it: every
    writer gives it a random `written`) and of every file's name and size. Two checkpoints written apart differ in it,
    a base re-converted in place from other weights of the same shape included; it reads no tensor (a 70B checkpoint
    is named in milliseconds), so it tells another checkpoint from this one, not a flipped bit in a shard. An adapter
    checkpoint keeps its base's identity (`core.modeling.lora`), and a resume or a merge on another base is refused by
    it."""
    import hashlib

    folder = Path(ckpt)
    digest = hashlib.sha256((folder / CONFIG_FILE).read_bytes())
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CONFIG_FILE):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()[:16]
