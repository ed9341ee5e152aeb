"""How many parameters a model trains, counted once over its layout (a run's result reports it)."""

from __future__ import annotations

import torch


def trainable(model: list[torch.nn.Module]) -> int:
    """The model's parameters that train, each counted once whatever the layout: a tensor-parallel shard on every
    rank of its group, a replicated tensor on the group's first rank, a pipeline stage's copy of the tied embedding
    never (`shared`), and an expert's on the first rank of its expert-data-parallel group (the dense parameters on the
    first data-parallel rank). Collective: every rank calls it. This rank's count alone was the model's at TP=1 only."""
    from megatron.core import parallel_state as ps

    dense = expert = 0
    for p in (p for m in model for p in m.parameters() if p.requires_grad and not getattr(p, "shared", False)):
        sharded = getattr(p, "tensor_model_parallel", False)
        if not getattr(p, "allreduce", True):  # Megatron-Core's mark of an expert's parameter
            expert += p.numel() if sharded or ps.get_expert_tensor_parallel_rank() == 0 else 0
        elif sharded or ps.get_tensor_model_parallel_rank() == 0:
            dense += p.numel()
    device = next(p.device for m in model for p in m.parameters())  # NCCL reduces device tensors only
    counted = torch.tensor([dense * (ps.get_data_parallel_rank(with_context_parallel=True) == 0)
                            + expert * (ps.get_expert_data_parallel_rank() == 0)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(counted)
    return int(counted.item())
