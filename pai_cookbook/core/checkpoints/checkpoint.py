"""Megatron-Core distributed checkpoints as the cookbook writes them: atomic and self-describing.

A checkpoint folder holds
- Megatron-Core's torch_dist files (whole tensors stored as chunks: loadable at any TP/PP/EP layout
  that divides the model; Megatron-Core reshards on load);
- `pai_cookbook.json`: the ModelConfig, dtype and provenance, so nothing else is needed to load it;
- `hf_assets/`: the Hugging Face config.json and tokenizer files it came from, so exporting or
  generating needs no manual copy step.
Every writer fills `<folder>.partial` and renames it into place as its last step: a run killed
mid-write leaves only the .partial folder, which no loader opens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint_format
from pai_cookbook.core.checkpoints.checkpoint_config import (  # noqa: F401
    CONFIG_FILE,
    DTYPE_NAMES,
    ITER_PREFIX,
    PARTIAL_SUFFIX,
    description,
    finished_iterations,
    partial_dir,
    read_config,
    resolve,
)
from pai_cookbook.core.checkpoints.full_disk import DISK_FULL_BYTES, disk_full, full_disk_said, worker_writes  # noqa: F401
from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.core.modeling.lora import is_adapter_key
from pai_cookbook.core.text import tokenizer

HF_ASSETS = "hf_assets"
ASSET_FILES = ("config.json", "generation_config.json") + tokenizer.FILES


def check_writable(out: str | Path, overwrite: bool, how_to_overwrite: str = "overwrite=True") -> None:
    """Refuse an output folder that already holds files, unless overwriting was asked for."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder; choose another output folder.")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already holds files; choose another folder or set {how_to_overwrite} "
                              f"to replace it.")
    # The parent too: the write goes to <out>.partial beside `out` and is renamed into place.
    read_only = [p for p in (nearest_existing(out.parent), out) if p.exists() and not os.access(p, os.W_OK)]
    if read_only:
        raise PermissionError(f"{out} cannot be written by this user ({read_only[0]} is read-only); choose a "
                              f"writable folder.")


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where creating `path` would start."""
    while not path.exists():
        path = path.parent
    return path


def prepare(out: str | Path, overwrite: bool) -> Path:
    """Check `out` may be written and return a fresh, empty `<out>.partial` to write into."""
    check_writable(out, overwrite)
    partial = partial_dir(out)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


@contextlib.contextmanager
def writing(out: str | Path, overwrite: bool) -> Iterator[Path]:
    """A fresh `<out>.partial` to write into, published as `out` when the block completes; removed
    when it fails (a full disk, a crash, a timeout, an interrupt), so it neither keeps a disk full nor
    looks like a checkpoint.

    Raises:
        FileExistsError: `out` holds files and overwrite is False.
        lock.FolderInUse: another process writes `out` (checked before anything is removed).
    """
    from pai_cookbook.core.launching import lock

    with lock.hold(out, "writing a checkpoint"):
        partial = prepare(out, overwrite)
        try:
            yield partial
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        publish(partial, out)


def publish(partial: Path, out: str | Path) -> Path:
    """Move a complete `.partial` folder into place: the last step of every writer."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def write_config(folder: Path, model: ModelConfig, dtype: torch.dtype, **provenance: Any) -> None:
    """The checkpoint's description, with a name of this write (`written`, random): every writer writes it, so a
    checkpoint written again in place (re-converted from other weights of the same shape) has another
    `checkpoint_config.identity`, and adapters trained on the old one are refused on it."""
    import uuid

    (folder / CONFIG_FILE).write_text(json.dumps(
        {"model": asdict(model), "dtype": DTYPE_NAMES[dtype], "format": "torch_dist", "written": uuid.uuid4().hex}
        | provenance, indent=2))


def copy_assets(src: Path, dst: Path) -> list[str]:
    """Copy the Hugging Face config and tokenizer files that exist in `src` into `dst`."""
    return tokenizer.copy(src, dst, ASSET_FILES)


def load_tokenizer(ckpt: str | Path):
    """The Hugging Face tokenizer a checkpoint (or a save folder's latest) carries in `hf_assets/`."""
    return tokenizer.load(resolve(ckpt) / HF_ASSETS, what=f"checkpoint {ckpt}")


def _state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    # Megatron-LM's convention: "model" for one chunk, "model0", "model1", ... with virtual pipeline. A model with LoRA
    # adapters (core.modeling.lora) is its adapters alone: the base is the checkpoint it was loaded from.
    states = [chunk.sharded_state_dict() for chunk in chunks]
    states = [{k: v for k, v in s.items() if is_adapter_key(k)} if any(map(is_adapter_key, s)) else s for s in states]
    return {"model": states[0]} if len(chunks) == 1 else {f"model{i}": s for i, s in enumerate(states)}


def _save_collective(tree: dict[str, Any], out: str | Path, model: ModelConfig, dtype: torch.dtype,
                     assets: Path | Sequence[Path] | None, **provenance: Any) -> Path:
    """The write protocol of every checkpoint (collective): rank 0 makes `<out>.partial`, all ranks save
    their shards into it, rank 0 adds the config and assets (from each folder of `assets` in turn, a later
    one's files replacing an earlier one's) and renames it to `out`."""
    from megatron.core import dist_checkpointing

    partial = partial_dir(out)
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    torch.distributed.barrier()
    with full_disk_said(partial):
        dist_checkpointing.save(tree, str(partial))
    torch.distributed.barrier()
    if rank0:
        checkpoint_format.common_state_where_older_releases_read_it(partial)
        write_config(partial, model, dtype, **provenance)
        for folder in [assets] if isinstance(assets, Path) else assets or []:
            if folder.exists():
                copy_assets(folder, partial / HF_ASSETS)
        publish(partial, out)
    torch.distributed.barrier()
    return Path(out)


def save(chunks: list[torch.nn.Module], out: str | Path, model: ModelConfig, dtype: torch.dtype, *,
         assets: Path | Sequence[Path] | None = None, **provenance: Any) -> Path:
    """Save this rank's model chunks (collective: every rank calls it) into `out`, atomically."""
    return _save_collective(_state(chunks), out, model, dtype, assets, **_marks(chunks), **provenance)


def head(ckpt: str | Path) -> str:
    """What a checkpoint's last layer is: "lm" (logits over the vocabulary) or "reward" (a scalar head)."""
    read_config(ckpt)
    return description(ckpt).get("head", "lm")


def _head_of(chunks: list[torch.nn.Module]) -> str:
    from pai_cookbook.core.modeling.model import ScalarHead

    return "reward" if any(isinstance(m, ScalarHead) for chunk in chunks for m in chunk.modules()) else "lm"


def _marks(chunks: list[torch.nn.Module]) -> dict[str, str]:
    return {"head": "reward"} if _head_of(chunks) == "reward" else {}


def load(chunks: list[torch.nn.Module], ckpt: str | Path) -> None:
    """Load a checkpoint into this rank's model chunks, whatever layout it was saved at.

    A reward model (`build_model(head="reward")`) loads a language model's checkpoint as its start: every
    weight but the output layer, whose place its own new head takes. The other way round is refused. A model with
    LoRA adapters loads an adapter checkpoint (`_load_into`).
    """
    from megatron.core import dist_checkpointing

    saved, wanted = head(ckpt), _head_of(chunks)  # head() raises clearly for a folder that is no checkpoint
    if saved != wanted and wanted == "lm":
        raise ValueError(f"{ckpt} is a reward model (a scalar head, no logits over the vocabulary): it scores "
                         f"completions (pai_cookbook.reward_model) but cannot be loaded as a language model.")
    fresh_head = saved != wanted  # a language model's weights under a new reward head
    requested = _state(chunks)
    if fresh_head:
        for state in requested.values():
            for key in [k for k in state if k.startswith("output_layer.")]:
                del state[key]
    state = dist_checkpointing.load(requested, str(ckpt))
    for i, chunk in enumerate(chunks):  # virtual PP: all chunks were loaded in one call
        _load_into(chunk, state["model" if len(chunks) == 1 else f"model{i}"], ckpt, fresh_head)


def _load_into(chunk: torch.nn.Module, loaded: dict[str, Any], ckpt: str | Path, fresh_head: bool = False) -> None:
    """Every weight of `chunk` from `loaded`, but a fresh reward head's own and, from adapters alone, the base's."""
    adapters_only = any(map(is_adapter_key, loaded))
    missing, unexpected = chunk.load_state_dict(loaded, strict=not (fresh_head or adapters_only))
    lost = [k for k in missing if is_adapter_key(k) or not (adapters_only or k.startswith("output_layer."))]
    if unexpected or lost:
        raise ValueError(f"loading {ckpt}: missing {lost}, unexpected {unexpected}")


# ------------------------------------------------------------------------------------------------
# Training checkpoints: model + optimizer + LR schedule + step + RNG, in save_dir/iter_NNNNNNN
# ------------------------------------------------------------------------------------------------
def iteration_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir) / f"{ITER_PREFIX}{step:07d}"


def resume_point(ckpt: Any) -> Path | None:
    """The checkpoint a run resumes from, the one rule every trainer follows: the latest finished one in its save_dir
    when it resumes (`CheckpointConfig.resume`, the default); None where it starts from load_dir's weights or from
    scratch. What is damaged is set aside before this is asked (`damage.set_damaged_aside`, the launch's preflight)."""
    latest = finished_iterations(ckpt.save_dir)[-1:] if ckpt.save_dir and ckpt.resume else []
    return latest[0] if latest else None


def saved_layout(ckpt: str | Path) -> dict[str, int] | None:
    """The layout (tp, pp, ep, world) a training checkpoint was saved at; None for a weights-only one."""
    return description(ckpt).get("saved_at")


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_initialized():  # the generator of the GPU this run computes on
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _training_state(chunks, optimizer, scheduler, step: int, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = _state(chunks)
    # The distributed optimizer's state as each DP rank holds it, Megatron-LM's default. Megatron-Core's own default
    # ('fully_sharded_model_space') builds flattened-range shards that its checkpointing refuses to save. A resume
    # is at the saved layout only (`layout`), so resharding in DP alone is enough. The other optimizers ignore it.
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                      metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    state["scheduler"] = scheduler.state_dict()
    state["step"] = step
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # One RNG state per rank: restored only at the same world size (checked before resuming).
    state["rng"] = ShardedObject("rng_state", _rng_state() if not is_loading else None, (world,), (rank,),
                                 replica_id=0)
    return state


def save_training(chunks, optimizer, scheduler, step: int, save_dir: str | Path, model: ModelConfig,
                  dtype: torch.dtype, layout: dict[str, int], *, keep_last: int, assets: Path | Sequence[Path] | None = None,
                  run: dict[str, Any] | None = None, **state: Any) -> Path:
    """Save everything a run needs to continue exactly (collective), then keep only the last `keep_last`.
    `run`: the job that trained it (a resume compares itself with it: `saved_run`); `state`: small JSON values a
    worker keeps beside the weights (config.json; `read_state` returns them)."""
    out = _save_collective(_training_state(chunks, optimizer, scheduler, step, is_loading=False),
                           iteration_dir(save_dir, step), model, dtype, assets, step=step, saved_at=layout,
                           **_marks(chunks), **({"run": run} if run else {}), **({"state": state} if state else {}))
    if torch.distributed.get_rank() == 0:
        for old in finished_iterations(save_dir)[:-keep_last]:
            shutil.rmtree(old)
    torch.distributed.barrier()
    return out


def saved_run(ckpt: str | Path) -> dict[str, Any] | None:
    """The job (`dataclasses.asdict`) that trained a checkpoint; None for checkpoints saved before it was kept."""
    return description(ckpt).get("run")


def read_state(ckpt: str | Path) -> dict[str, Any]:
    """The `state` save_training kept beside a checkpoint's weights ({} when none)."""
    return description(ckpt).get("state", {})


def chained_optimizers(optimizer) -> list:
    """The optimizers `get_megatron_optimizer` made: a `ChainedOptimizer`'s each (one for dense parameters, one for
    experts at EP > 1, ...), or `optimizer` itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed_torch_adams(chained: list) -> list:
    """Those of `chained` that are distributed optimizers stepping torch's Adam (no Transformer Engine or Apex: CPU).

    Megatron-Core 0.16 loads their state as it does TE's and Apex's Adam, which keep the step count in the parameter
    groups, and torch's Adam keeps it in each parameter's state. Two consequences, handled in `load_training` (which
    also loads under `torch.no_grad()`: the fp32 shards it copies into are views of fp32 weights).
    - `DistributedOptimizer.sharded_state_dict(is_loading=True)` reads one step count from the per-parameter state,
      which is empty before the first step.
    - `DistributedOptimizer.load_state_dict` hands every parameter the same step tensor (which torch's Adam would
      increment once per parameter), and the parameter state's load then copies the step of the state it was given
      to load into (the filled one) over it. `load_training` sets each parameter's step from the saved groups."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [inner for inner in chained
            if isinstance(inner, DistributedOptimizer) and isinstance(inner.optimizer, torch.optim.Adam)]


def _fill_adam_state(inner) -> None:
    """Give a fresh distributed optimizer's torch Adam its per-parameter state (what the load overwrites): a step
    on zero gradients at learning rate 0, as Megatron-Core fills it for its FSDP format, so that neither the update
    nor the weight decay moves a weight."""
    adam = inner.optimizer
    if adam.state:
        return
    rates = [group["lr"] for group in adam.param_groups]
    for group in adam.param_groups:
        group["lr"] = 0.0
    try:
        inner._init_optimizer_states_with_dummy_values()
    finally:
        for group, rate in zip(adam.param_groups, rates):
            group["lr"] = rate


def load_training(chunks, optimizer, scheduler, ckpt: str | Path) -> int:
    """Restore model, optimizer, LR schedule and RNG from a training checkpoint; returns its step."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    chained = chained_optimizers(optimizer)
    torch_adams = _distributed_torch_adams(chained)
    for inner in torch_adams:
        _fill_adam_state(inner)
    state = dist_checkpointing.load(_training_state(chunks, optimizer, scheduler, 0, is_loading=True), str(ckpt))
    for i, chunk in enumerate(chunks):  # an adapters-only state leaves the base's weights as they are
        _load_into(chunk, state["model" if len(chunks) == 1 else f"model{i}"], ckpt)
    # one state per chained optimizer, in the order ChainedOptimizer.load_state_dict gives them out
    saved_states = [state["optimizer"]] if len(chained) == 1 else [v for _, v in sorted(state["optimizer"].items())]
    checkpoint_format.schedule_asked_for([g for inner in chained for g in inner.optimizer.param_groups], state["optimizer"])
    with torch.no_grad():  # the distributed optimizer copies into its fp32 shards, views of the fp32 weights
        optimizer.load_state_dict(state["optimizer"])
    for inner, saved in zip(chained, saved_states, strict=True):
        if inner in torch_adams:
            (step,) = {group["step"] for group in saved["optimizer"]["param_groups"]}
            for param_state in inner.optimizer.state.values():  # its own tensor each, as torch's Adam counts them
                param_state["step"] = torch.tensor(float(step), dtype=param_state["step"].dtype,
                                                   device=param_state["step"].device)
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
    if "cuda" in rng and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(rng["cuda"])
    return int(state["step"])
