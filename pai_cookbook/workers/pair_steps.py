"""What the pairwise workers share (the reward model's, `workers.reward`, and preference tuning's, `workers.dpo`): a
step's pairs split over the data-parallel ranks into micro-batches, run through Megatron-Core's pipeline schedule with
the loss scaled to its share of the global per-pair mean, and the held-out pairs scored forward-only in whole
micro-batches (pipeline stages exchange fixed shapes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pai_cookbook.workers import training


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
