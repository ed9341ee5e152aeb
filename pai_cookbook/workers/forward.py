"""One forward pass of one batch at any TP/PP layout, without gradients, and what the last pipeline stage computes from
its output returned on global rank 0: the parity worker's full logits, the evaluation worker's scores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def last_stage(chunks: list[torch.nn.Module], tokens: torch.Tensor, collect: Callable[[torch.Tensor], Any]) -> Any:
    """`collect(output)` on the last pipeline stage (every tensor-parallel rank of it calls it, so it may hold
    collectives over the tensor-parallel group), for the model's output on `tokens` (causal, positions 0..n-1);
    returned on global rank 0, None elsewhere. What `collect` returns crosses ranks as a Python object: keep it small
    and on the host."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator), positions, attention_mask=None)
        return output, lambda output_tensor, non_loss_data=False: collect(output_tensor)

    with torch.no_grad():
        collected = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter([tokens]) for _ in chunks] if len(chunks) > 1
            else iter([tokens]), model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True,
            collect_non_loss_data=True)
    mine = collected[0] if (collected and ps.get_tensor_model_parallel_rank() == 0
                            and ps.get_data_parallel_rank() == 0) else None
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)  # the last stage's result reaches rank 0
    found = next(x for x in gathered if x is not None)
    return found if torch.distributed.get_rank() == 0 else None
