"""Training from a notebook, a script or a batch job: check everything checkable, then launch.

    result = train.run(config, nproc_per_node=2)      # a RunConfig; returns this launch's history
    curve = train.history(run_dir)                    # every step so far, across resumed launches
    results = train.sweep({"bf16": a, "fp8": b})      # several runs in one launch: name -> result

CLI: `python -m pai_cookbook.train --config run.json --nproc-per-node 8` (exit code 2 on bad input,
before any worker starts; 1 on a worker failure). The training loop itself runs under torchrun in
`pai_cookbook.workers.train`.

Re-running never destroys finished work: with `checkpoint.resume` (the default) a run continues from
save_dir's latest finished checkpoint (a run that reached train_iters has nothing left to do, and
re-running it only reads its history); a save_dir that holds checkpoints is emptied only when the
caller sets `checkpoint.overwrite=True` with `resume=False`. A resumed run is the run asked for: a longer
run or a new schedule is applied and said (`resume_changes`), another model, precision, data or seed is
refused. The launching process holds the save_dir's and run folder's locks (`core.launching.lock`), so a second writer
is refused before it deletes anything, and its workers end with it however it ends. A non-finite step stops
the run before it saves anything, so the last checkpoint is always a finite one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pai_cookbook import data, sft
from pai_cookbook.core.checkpoints import checkpoint, checkpoint_config, damage
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import (
    ConfigError,
    RunConfig,
)
from pai_cookbook.core.launching import cli, inputs, lock, nodes
from pai_cookbook.core.launching import launch as launcher
from pai_cookbook.core.launching.failures import WorkerError
from pai_cookbook.core.launching.job import decided
from pai_cookbook.core.launching.jobs import Sweep
from pai_cookbook.core.machine import runtime


@nodes.node0_only
def preflight(config: RunConfig, world_size: int) -> None:
    """Checks that need this machine's filesystem, done before any worker starts (on node 0 of a
    multi-node job, which also empties save_dir when that was asked for).

    Raises:
        ConfigError / DataError / FileExistsError: naming the problem and the fix.
    """
    ckpt = config.checkpoint
    if config.data.source == "indexed":
        data.check_for_training(config)
    elif config.data.source == "sft":
        sft.check_for_training(config)
    if ckpt.load_dir:
        loaded, _ = checkpoint.read_config(ckpt.load_dir)
        differ = [f.name for f in dataclasses.fields(loaded)
                  if getattr(loaded, f.name) != getattr(config.model, f.name) and f.name not in _TRAINING_ONLY]
        if differ:
            raise ConfigError(f"checkpoint.load_dir {ckpt.load_dir} holds a model that differs from config.model in "
                              f"{differ}; build config.model with checkpoint.read_config(load_dir)[0].")
    if not ckpt.save_dir:
        return
    for unfinished in Path(ckpt.save_dir).glob(f"{checkpoint.ITER_PREFIX}*{checkpoint.PARTIAL_SUFFIX}"):
        shutil.rmtree(unfinished)  # a killed save's leftovers: never loadable, and they hold disk
    set_aside = damage.set_damaged_aside(ckpt.save_dir) if ckpt.resume else []
    latest = checkpoint.resume_point(ckpt)
    for line in set_aside:
        print(f"train: {line}; " + (f"resuming from {latest.name}." if latest else
                                    "no complete checkpoint is left, so the run starts from its beginning."))
    if set_aside and not latest:
        return  # save_dir holds only what was set aside: the run starts over beside it
    if latest is not None:
        base = checkpoint.read_state(latest).get("lora_base")
        if base is not None and base["identity"] != checkpoint_config.identity(ckpt.load_dir):
            raise ConfigError(f"cannot resume {latest}: its adapters were trained on {base['path']} (identity "
                              f"{base['identity']}), and checkpoint.load_dir {ckpt.load_dir} is another checkpoint. "
                              f"Point load_dir at that base, or start the adapters over in another save_dir.")
        saved, wanted = checkpoint.saved_layout(latest) or {}, layout.record(config.parallel, world_size)
        if not layout.same_layout(saved, wanted):
            raise ConfigError(f"cannot resume {latest}: it was saved at {saved}, this run is {wanted}. Resume "
                              f"at the saved layout, or start a new run from it with checkpoint.load_dir (weights "
                              f"only; Megatron-Core reshards them) and another save_dir.")
        changed = resume_changes(config, latest)
        if changed:
            print(f"train: resuming {latest} with {', '.join(changed)}; the steps left follow the new values (the "
                  f"learning-rate schedule is recomputed for them).")
        return
    if ckpt.overwrite:  # asked for by name: resume=False and overwrite=True
        shutil.rmtree(ckpt.save_dir, ignore_errors=True)
        return
    checkpoint.check_writable(ckpt.save_dir, False, "checkpoint.overwrite=True (or resume=True)")


# What a resume may change: the worker builds the learning-rate schedule from the run asked for, so the steps left
# follow new values. Anything else that differs (the model, its precision, the data stream, the seed) is another
# run, refused by `resume_changes`.
RESUMABLE = ("train_iters", "optimizer.lr", "optimizer.min_lr", "optimizer.lr_warmup_iters", "optimizer.lr_decay_style",
             "optimizer.weight_decay", "optimizer.adam_beta1", "optimizer.adam_beta2", "optimizer.adam_eps",
             "optimizer.clip_grad", "checkpoint", "log_interval", "eval_interval", "eval_iters", "data.micro_batch_size",
             "memory", "precision.fp8", "measure_memory")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def resume_changes(config: RunConfig, latest: Path) -> list[str]:
    """What this run changes of the run that saved `latest` ("train_iters 6 -> 12"), where a resume may change it.

    Raises:
        ConfigError: a change that makes another run (the model's shape, its precision, the data, the seed), naming
        both values and the fix; for checkpoints saved without their run, a model that differs.
    """
    asked = _flat(json.loads(json.dumps(dataclasses.asdict(config))))  # as JSON holds it: tuples as lists
    saved = checkpoint.saved_run(latest)
    if saved is None:  # saved before runs were recorded: the model is what can be compared
        loaded, _ = checkpoint.read_config(latest)
        saved = _flat({"model": dataclasses.asdict(loaded)})
        asked = {k: v for k, v in asked.items() if k in saved}
    else:
        saved = _flat(saved)
    differ = [k for k in sorted(set(saved) | set(asked)) if saved.get(k) != asked.get(k)]
    training_only = {f"model.{name}" for name in _TRAINING_ONLY}
    fixed = [k for k in differ if k not in training_only and not any(k == r or k.startswith(r + ".") for r in RESUMABLE)]
    if fixed:
        shown = "; ".join(f"{k}: saved {saved.get(k)!r}, asked {asked.get(k)!r}" for k in fixed[:6])
        raise ConfigError(f"cannot resume {latest}: this run differs from the one that saved it in {shown}. A resume "
                          f"continues the same run; start another with a new checkpoint.save_dir (load_dir={latest} "
                          f"starts it from these weights), or replace this one with resume=False and overwrite=True.")
    return [f"{k} {saved.get(k)!r} -> {asked.get(k)!r}" for k in differ]


# ModelConfig fields that shape training but not the weights: a checkpoint may be trained on with others.
_TRAINING_ONLY = {"hidden_dropout", "attention_dropout", "init_method_std", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                  "moe_router_load_balancing_type", "moe_token_dispatcher_type", "moe_grouped_gemm",
                  "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"}




def run(config: RunConfig, *, nproc_per_node: int = 1, run_dir: str | Path = "runs/train",
        **launch_kwargs: Any) -> dict[str, Any]:
    """Train under torchrun from a notebook or script; returns rank 0's result (losses, tokens/s).

    Every entry point (this function, the CLI, notebooks) checks the same things before launch:
    the layout against the model and world (`RunConfig.validate`), then the files (`preflight`).
    """
    return launch_training(config, [config], config.validate, nproc_per_node=nproc_per_node, run_dir=run_dir,
                           **launch_kwargs)


def launch_training(job, runs: list[RunConfig], check: Callable[[int, Any], None], *, nproc_per_node: int,
                    run_dir: str | Path, before: Callable[[], None] | None = None,
                    after: Callable[[], None] | None = None, **launch_kwargs: Any) -> dict[str, Any]:
    """The one way a training job starts (`run`, `sweep`, `rlhf`'s GRPO and PPO, `reward_model.train`), in this order:
    `check(world, device)` (the job against the world and this machine, once), the locks of every folder the runs
    write (`writing`: a second writer is refused before anything is deleted; a full disk is said as such), `before()`,
    each run's `preflight` (its files, and the resume rule: a damaged latest checkpoint set aside, a finished run's
    history read, an occupied save_dir refused or emptied as asked), `after()`, then the launch.

    A save folder given as a run's `checkpoint.load_dir` is resolved first to its latest finished iteration
    (`checkpoint.resolve`), which the config then names: the workers load what the checks read.

    Returns rank 0's result."""
    for config in runs:
        if config.checkpoint.load_dir:
            config.checkpoint.load_dir = str(checkpoint.resolve(config.checkpoint.load_dir))
    world = runtime.detect_launch_env().world_size(nproc_per_node)
    # the device as the launcher will decide it for this job (its layers narrowed), so both checks see one machine
    _, device = decided(job, runtime.detect_device({**os.environ, **(launch_kwargs.get("env") or {})}))
    check(world, device)
    with writing(runs, run_dir):
        if before is not None:
            before()
        for config in runs:
            preflight(config, world)
        if after is not None:
            after()
        return launcher.launch(job, nproc_per_node=nproc_per_node, run_dir=run_dir, **launch_kwargs)


@contextlib.contextmanager
def writing(configs: list[RunConfig], run_dir: str | Path) -> Iterator[None]:
    """Hold the locks of the folders these runs write (`core.launching.lock`), on node 0 (a multi-node job's other nodes
    write what node 0's launch directs): a second writer is refused before its checks delete anything. A worker that
    fails where a folder's disk is full is said to have (`checkpoint.disk_full`), naming the folder."""
    folders = [run_dir] + [c.checkpoint.save_dir for c in configs if c.checkpoint.save_dir]
    with contextlib.ExitStack() as stack:
        if runtime.detect_launch_env().node_rank == 0:
            for folder in folders:
                stack.enter_context(lock.hold(folder, "training"))
        stack.enter_context(checkpoint.full_disk_said(*reversed(folders), catch=WorkerError))
        yield


def sweep(runs: Mapping[str, RunConfig], *, nproc_per_node: int = 1, run_dir: str | Path = "runs/sweep",
          **launch_kwargs: Any) -> dict[str, dict[str, Any]]:
    """Train several configs one after another in one launch (recipes, seeds, learning rates side by side).

    Each run is exactly what `run(config)` would train; torchrun's and Megatron-Core's start-up (seconds
    per launch) are paid once. Every config is checked before the launch, as `run` checks one.
    Args:
        runs: name -> RunConfig. A run logs into run_dir/<name> (characters other than letters, digits,
            "-", "_" and "." become "_"), so `history(run_dir / folder)` reads it.
    Returns:
        name -> the result `run` returns for that config, in the order given.
    """
    if not runs:
        raise ConfigError("sweep needs at least one run: {name: RunConfig}.")
    folders = {name: re.sub(r"[^\w.-]+", "_", name).strip("._") for name in runs}
    clashes = {f for f in folders.values() if list(folders.values()).count(f) > 1} | ({""} & set(folders.values()))
    if clashes:
        raise ConfigError(f"sweep run names {sorted(runs)} give the same or an empty folder name "
                          f"({sorted(clashes)}); name the runs so that their letters and digits differ.")
    job = Sweep(names=list(runs), folders=list(folders.values()), runs=list(runs.values()))

    def check(world: int, device: Any) -> None:
        for config in runs.values():
            config.validate(world, device)

    result = launch_training(job, list(runs.values()), check, nproc_per_node=nproc_per_node, run_dir=run_dir,
                             **launch_kwargs)
    return {name: run | {"layers": result["layers"]} for name, run in zip(runs, result["runs"])}


def logged_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """run_dir/metrics.jsonl's records in step order, a step logged twice (a launch killed after logging
    it but before its checkpoint, then resumed) kept as its last record."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: no run has logged into {run_dir}.")
    by_step = {record["step"]: record for record in inputs.read_jsonl(path)}
    return [by_step[step] for step in sorted(by_step)]


def history(run_dir: str | Path) -> dict[str, Any]:
    """Every step a run has logged in run_dir/metrics.jsonl, across resumed launches.

    A step logged twice (a launch killed after logging it but before its checkpoint, then resumed)
    keeps its last record: the one the checkpoints continue from.
    Returns:
        {"steps", "losses", "grad_norms", "valid_losses" ([(step, loss)]), "tokens_per_s", "mfu" (against the GPUs' datasheet
        peak; None on a CPU or an unknown GPU), "mfu_of_measured_peak" (against the matmul peak measured at the
        start)}, in step order; with
        emulated FP8 also "fp8": per step, per linear and operand, amax, scale, overflow and underflow.
    """
    records = logged_steps(run_dir)
    return {"steps": [r["step"] for r in records], "losses": [r["loss"] for r in records],
            "grad_norms": [r.get("grad_norm") for r in records],
            "valid_losses": [(0, r["valid_loss_at_start"]) for r in records[:1] if "valid_loss_at_start" in r]
                            + [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r],
            "tokens_per_s": [r["tokens_per_s"] for r in records], "mfu": [r["mfu"] for r in records],
            "mfu_of_measured_peak": [r.get("mfu_of_measured_peak") for r in records]} | (
        {"fp8": [r["fp8"] for r in records]} if records and "fp8" in records[0] else {})


def utilization(curve: dict[str, Any]) -> dict[str, float | None]:
    """The mean over a `history` of MFU (model FLOP/s against the GPUs' datasheet dense peak: None on a CPU or a GPU
    `core.measures.throughput.DATASHEET_DENSE_TFLOPS` lacks) and of the fraction of the matmul peak measured at the start."""
    def mean(values: list) -> float | None:
        return None if not values or any(v is None for v in values) else sum(values) / len(values)

    return {"mfu": mean(curve["mfu"]), "mfu_of_measured_peak": mean(curve["mfu_of_measured_peak"])}


def describe_utilization(figures: dict[str, float | None]) -> str:
    """`utilization`'s figures in words, each under its own name (a CPU has no datasheet MFU)."""
    measured = f"{figures['mfu_of_measured_peak']:.1%} of the measured matmul peak"
    if figures["mfu"] is None:
        return f"MFU: no datasheet peak for this device; {measured}"
    return f"MFU {figures['mfu']:.1%} (of the datasheet peak); {measured}"


def main(argv: list[str] | None = None) -> int:
    """CLI: exit 0 on success, 1 on a worker failure, 2 on bad input; messages fit a cluster log."""
    parser = argparse.ArgumentParser(prog="python -m pai_cookbook.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="RunConfig JSON (RunConfig.save)")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/train"))
    parser.add_argument("--timeout-s", type=float)
    opts = parser.parse_args(argv)
    return cli.finish("pai_cookbook.train", lambda: run(RunConfig.load(opts.config), nproc_per_node=opts.nproc_per_node,
                                                         run_dir=opts.run_dir, timeout_s=opts.timeout_s,
                                                         show_progress=False))


if __name__ == "__main__":
    sys.exit(main())
