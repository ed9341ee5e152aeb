"""What the pairwise workers share (the reward model's, `workers.reward`, and preference tuning's, `workers.dpo`): a
step's pairs split over the data-parallel ranks into micro-batches, run through Megatron-Core's pipeline schedule with
the loss scaled to its share of the global per-pair mean, the held-out pairs scored forward-only in whole
micro-batches (pipeline stages exchange fixed shapes), and the run itself (`train`): its steps, held-out figures,
checkpoints and the stop at a non-finite step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.launching import worker
from pai_cookbook.workers import run_state, training


def micro_batches(pairs: Sequence[Any], size: int, make_batch: Callable[[list], dict]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of `pairs`, in micro-batches of `size` pairs made by `make_batch`."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = len(pairs) // dp_size
    mine = list(pairs[dp_rank * per_rank:(dp_rank + 1) * per_rank])
    return [make_batch(mine[start:start + size]) for start in range(0, len(mine), size)]


def run(config, model, batches: list[dict[str, Any]], forward_step: Callable, pairs_per_micro_batch: int,
        forward_only: bool):
    """The pipeline schedule over `batches` (each holds 2 x `pairs_per_micro_batch` rows: chosen, then rejected),
    every loss scaled to its share of the global per-pair mean (`training.per_token_scale`, one count per pair)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    scale = training.per_token_scale(batches)
    batches = [b | {"loss_scale": scale} for b in batches]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=model[0], num_microbatches=len(batches),
        seq_length=config.data.seq_length, micro_batch_size=2 * pairs_per_micro_batch,
        decoder_seq_length=config.data.seq_length, forward_only=forward_only)


def held_out(config, model, pairs: Sequence[Any], size: int, make_batch: Callable[[list], dict],
             forward_step: Callable) -> tuple[list, int]:
    """The schedule's reports over the held-out pairs that fill whole micro-batches on every rank, forward-only in
    eval mode, and how many pairs that was."""
    from megatron.core import parallel_state as ps

    usable = len(pairs) - len(pairs) % (ps.get_data_parallel_world_size() * size)
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        reports = run(config, model, micro_batches(pairs[:usable], size, make_batch), forward_step, size,
                      forward_only=True)
    for chunk in model:
        chunk.train()
    return reports, usable


def train(config, device, model, optimizer, scheduler, *, pairs: Sequence[Any], per_step: int,
          batches_of: Callable[[list], list], run_pairs: Callable[..., list], figures: Callable[[list], dict],
          evaluate: Callable[[], dict] | None, interval: int, evaluate_first: bool = False) -> dict[str, Any]:
    """A pairwise run: resumed or started (`run_state.restore`); each step `per_step` pairs from seeded passes over
    `pairs`, this rank's share in micro-batches (`batches_of`), through `run_pairs` and one optimizer step; the held-out figures
    (`evaluate`; None without held-out pairs) every `interval` steps and after the last, and before the first where
    `evaluate_first`; a checkpoint when due. A step whose loss or gradient norm is not finite stops the run before
    anything of it is saved (`run_state.stop_non_finite`), as a training run stops. A finished run asked again returns
    its checkpoint and its held-out figures."""
    first_step, started_from = run_state.restore(config, model, optimizer, scheduler)
    log = run_state.StepLog(config, device, fresh=first_step == 0)
    assets = Path(config.checkpoint.load_dir) / checkpoint.HF_ASSETS
    history, valid, saved = [], [], None
    if evaluate is not None and evaluate_first and first_step == 0:
        valid.append({"step": 0} | evaluate())
    for step in range(first_step, config.train_iters):
        indices = run_state.seeded_passes(len(pairs), step, per_step, config.seed)
        batches = batches_of([pairs[i] for i in indices])
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = run_pairs(model, batches, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        step_figures = figures(reports) | {"grad_norm": float(grad_norm or 0.0), "lr": optimizer.param_groups[0]["lr"]}
        scheduler.step(increment=1)
        done = step + 1
        run_state.stop_if_non_finite(config, log, done, step_figures, started_from)
        if evaluate is not None and (done == config.train_iters or (interval and done % interval == 0)):
            held_out = evaluate()
            valid.append({"step": done} | held_out)
            step_figures |= {"valid_loss": held_out["loss"], "valid_accuracy": held_out["accuracy"]}
        saved = run_state.save_if_due(config, model, optimizer, scheduler, done, assets) or saved
        history.append(step_figures)
        log.write(done, step_figures)
        if worker.rank() == 0:
            worker.progress(done, config.train_iters, loss=step_figures["loss"], accuracy=step_figures["accuracy"])
    log.close()
    if first_step == config.train_iters:  # a finished run asked again: its checkpoint, and its held-out figures
        saved = Path(started_from)
        if evaluate is not None:
            valid.append({"step": first_step} | evaluate())
    return {"first_step": first_step, "started_from": started_from, "steps": history, "valid": valid,
            "checkpoint": str(saved) if saved else None, "world_size": torch.distributed.get_world_size(),
            "device": device.name}
