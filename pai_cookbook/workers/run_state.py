"""What a training run keeps between its steps and its launches: the step log (metrics.jsonl, progress), the order of
passes over a data set, saving when due (and never after a non-finite step), and a resume that follows the run asked
for. Shared by every training worker through `workers.training`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint, checkpoint_config
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import RunConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.machine.runtime import DeviceInfo
from pai_cookbook.core.measures import throughput
from pai_cookbook.core.modeling.model import torch_dtype, training_flops_per_token


class StepLog:
    """Per-step figures: tokens/s and MFU on every step, written by rank 0 to run_dir/metrics.jsonl and
    to TensorBoard (run_dir/tensorboard) when the launcher gave a run folder."""

    def __init__(self, config: RunConfig, device: DeviceInfo, fresh: bool, log_dir: str | Path | None = None):
        self.tokens_per_step = config.data.global_batch_size * config.data.seq_length
        self.flops_per_token = training_flops_per_token(config.model, config.data.seq_length,
                                                        frozen_weights=config.lora is not None)
        # MFU as the field reports it: model FLOP/s over the GPUs' datasheet dense peak for the precision of the
        # GEMMs (None on a CPU or a GPU the table lacks). Beside it, under its own name, the fraction of the measured
        # matmul peak: every rank measures its own device (and threads), and the world's figure is their sum.
        gemms = "fp8" if config.precision.fp8 is not None and config.precision.fp8.decided_backend == "te" \
            else config.precision.dtype
        world = torch.distributed.get_world_size()
        per_gpu = throughput.datasheet_peak_flops(device.name, gemms) if device.is_cuda else None
        self.datasheet_flops = None if per_gpu is None else per_gpu * world
        here = runtime.collective_device()  # this rank's GPU, or the CPU
        peak = torch.tensor([throughput.measure_matmul_peak(here, torch_dtype(config.precision))], dtype=torch.float64,
                            device=here)
        torch.distributed.all_reduce(peak)
        self.peak_flops = float(peak.item())
        self.jsonl = self.tensorboard = None
        run_dir = log_dir or os.environ.get(worker.RUN_DIR_ENV)
        if run_dir and worker.rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            # a run that starts at step 0 starts the log over; a resumed one continues it
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = worker.open_log(Path(run_dir) / "metrics.jsonl", fresh)
            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def throughput(self, seconds: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / seconds
        return {"tokens_per_s": tokens_per_s,
                "mfu": throughput.model_flops_utilization(tokens_per_s, self.flops_per_token, self.datasheet_flops),
                "mfu_of_measured_peak": throughput.model_flops_utilization(tokens_per_s, self.flops_per_token,
                                                                        self.peak_flops)}

    def write(self, step: int, figures: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps({"step": step} | figures) + "\n")
        self.jsonl.flush()
        for name, value in figures.items():
            if not isinstance(value, (int, float)):  # per-layer router lists stay in metrics.jsonl
                continue
            if name == "valid_loss_at_start":  # the validation before the first step, at step 0
                self.tensorboard.add_scalar("valid/loss", value, 0)
            else:
                self.tensorboard.add_scalar(f"train/{name}" if name != "valid_loss" else "valid/loss", value, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.tensorboard.close()


_PASS_SEED_STRIDE = 1_000_003  # a prime above any pass count: distinct (seed, pass) -> distinct orders


def seeded_passes(count: int, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of step `step`'s `per_step` items out of `count`: consecutive passes over the set, each in an
    order seeded by (seed, pass), so a step draws the same items at every layout and on a resumed run."""
    chosen, orders = [], {}
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, index = divmod(position, count)
        if epoch not in orders:
            orders[epoch] = torch.randperm(count, generator=torch.Generator().manual_seed(seed * _PASS_SEED_STRIDE + epoch))
        chosen.append(int(orders[epoch][index]))
    return chosen


def save_if_due(config: RunConfig, model, optimizer, scheduler, done: int, assets: Path | list[Path] | None,
                **state: Any) -> Path | None:
    """Save a training checkpoint after step `done` when it is the last or a multiple of save_interval
    (collective; `state`: see `checkpoint.save_training`); returns its folder, or None when none was due."""
    ckpt = config.checkpoint
    if not ckpt.save_dir or not (done == config.train_iters or (ckpt.save_interval and done % ckpt.save_interval == 0)):
        return None
    return save_now(config, model, optimizer, scheduler, done, assets, **state)


def save_now(config: RunConfig, model, optimizer, scheduler, done: int, assets: Path | list[Path] | None,
             **state: Any) -> Path:
    """Save a training checkpoint after step `done` into save_dir (collective). Weights holding NaN or Inf are never
    saved: the run stops instead (`NonFiniteError`), so every checkpoint a run leaves is one it can resume from."""
    ckpt = config.checkpoint
    if not weights_finite(model):
        stop_with(config, done, f"after step {done} the weights hold NaN or Inf (the update itself overflowed)")
    if config.lora is not None:  # an adapter checkpoint names the base it adapts (a resume or merge on another is refused)
        state["lora_base"] = {"path": str(ckpt.load_dir), "identity": checkpoint_config.identity(ckpt.load_dir)}
    return checkpoint.save_training([m.module for m in model], optimizer, scheduler, done, ckpt.save_dir, config.model,
                                    torch_dtype(config.precision),
                                    layout.record(config.parallel, torch.distributed.get_world_size()),
                                    keep_last=ckpt.keep_last, assets=assets, run=dataclasses.asdict(config), **state)


class NonFiniteError(RuntimeError):
    """A step's loss, gradient norm or weights are not finite: the run stops there, before anything of it is saved."""


_WATCHED = ("loss", "grad_norm", "value_loss", "critic_grad_norm")  # the last two: PPO's critic


def finite(figures: dict[str, Any]) -> bool:
    """Whether a step's losses and gradient norms (those of `_WATCHED` it reports) are all finite."""
    return all(math.isfinite(figures[key]) for key in _WATCHED if key in figures)


def weights_finite(model) -> bool:
    """Whether every rank's weights are all finite (collective: every rank gets the same answer)."""
    params = [p for chunk in model for p in chunk.parameters()]
    ok = torch.stack([torch.isfinite(p).all() for p in params]).all() if params else torch.tensor(True)
    flag = ok.to(torch.int32).reshape(1)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def stop_if_non_finite(config: RunConfig, log: StepLog, step: int, figures: dict[str, Any],
                       started_from: str | None) -> None:
    """Where `step`'s figures are not all `finite`: log them (the step that stopped the run is in metrics.jsonl),
    close the log and stop the run (`stop_non_finite`); else nothing."""
    if not finite(figures):
        log.write(step, figures)
        log.close()
        stop_non_finite(config, step, figures, started_from)


def stop_non_finite(config: RunConfig, step: int, figures: dict[str, float], started_from: str | None = None) -> None:
    """Stop the run at `step` (on every rank: the loss and gradient norm are global), naming the last finite
    checkpoint, which survives: nothing is saved after a non-finite step, so `keep_last` never removes it."""
    critic = (f", the critic's loss {figures['value_loss']} and gradient norm {figures['critic_grad_norm']}"
              if "value_loss" in figures else "")
    stop_with(config, step, f"step {step}: the loss is {figures['loss']} and the gradient norm {figures['grad_norm']}"
                        f"{critic}", started_from)


def stop_with(config: RunConfig, step: int, what: str, started_from: str | None = None) -> None:
    """Stop the run at `step` for `what` (a sentence without its end) by raising `NonFiniteError`, naming the last
    finite checkpoint (save_dir's latest, else where the run started) and what to change."""
    ckpt = config.checkpoint
    finished = checkpoint.finished_iterations(ckpt.save_dir) if ckpt.save_dir else []
    last = finished[-1] if finished else (started_from or ckpt.load_dir)
    made_it = ""
    if finished and finished[-1] == checkpoint.iteration_dir(ckpt.save_dir, step - 1):
        made_it = (f" Its weights made step {step}: if a re-run from it stops here again, move it out of "
                   f"{ckpt.save_dir} to resume from the one before.")
    fp8_hint = " the FP8 recipe or margin (precision.fp8)," if config.precision.fp8 is not None else ""
    raise NonFiniteError(
        f"{what}; the run stops here and saves nothing of this step. The last finite checkpoint is "
        f"{last or 'none (no checkpoint was saved)'}.{made_it} Try a lower learning rate (optimizer.lr, now "
        f"{config.optimizer.lr}), gradient clipping (optimizer.clip_grad, now {config.optimizer.clip_grad}),{fp8_hint} "
        f"or bf16 rather than fp16; a re-run resumes from the latest checkpoint.")


def follow_the_run_asked_for(config: RunConfig, optimizer, scheduler) -> None:
    """After a resume: the optimizer's parameter groups carry the saved run's peak and floor learning rates (which
    Megatron-Core's schedule reads before its own) and Adam settings; give them the run asked for
    (`train.resume_changes` allowed and said the change), and set this step's learning rate from the new schedule."""
    opt = config.optimizer
    for group in optimizer.param_groups:
        group["max_lr"], group["min_lr"] = opt.lr, opt.min_lr
        if "betas" in group:
            group["betas"] = (opt.adam_beta1, opt.adam_beta2)
        if "eps" in group:
            group["eps"] = opt.adam_eps
    scheduler.step(increment=0)


def restore(config: RunConfig, model, optimizer, scheduler) -> tuple[int, str | None]:
    """Resume from save_dir's latest checkpoint, or start from load_dir's weights; returns (step, source)."""
    ckpt = config.checkpoint
    modules = [m.module for m in model]
    latest = checkpoint.resume_point(ckpt)
    if latest is not None:
        step = checkpoint.load_training(modules, optimizer, scheduler, latest)
        if getattr(optimizer, "cookbook_fused_cpu_adam", False):  # cpu.adam.FUSED_MARK: the saved groups are unfused
            from pai_cookbook.cpu import adam

            adam.fuse_adam(optimizer)
        follow_the_run_asked_for(config, optimizer, scheduler)
        return step, str(latest)
    if ckpt.load_dir and config.lora is None:  # a LoRA run's base was loaded before its adapters (workers.training)
        checkpoint.load(modules, ckpt.load_dir)
        optimizer.reload_model_params()  # bf16: refresh the fp32 master copies from the loaded weights
    return (0, ckpt.load_dir) if ckpt.load_dir else (0, None)


