"""Megatron-Core's parallel linears with a short forward where nothing is recorded for backward.

Megatron-Core's `ColumnParallelLinear` / `RowParallelLinear` run every forward through an autograd
`Function` (`LinearWithGradAccumulationAndAsyncCommunication`, for gradient-accumulation fusion and overlapped
gradient all-reduces), and through two more (`copy_to_` / `reduce_from_tensor_model_parallel_region`) even at
TP=1, where they return their input; each looks its tensor-parallel group up again and warns through Python's
`warnings` that it was not given one. None of it does anything when no gradient is recorded (generation,
RL rollouts, evaluation) on a layer that exchanges nothing (TP=1, no sequence parallelism, no expert
communication): then these classes compute what Megatron-Core's forward computes, with the same ops (`matmul`
with the transposed weight, then the bias), so the outputs are bitwise the same. Anything else (gradients on,
TP > 1, sequence parallelism, experts spread over ranks) is Megatron-Core's own forward, unchanged.

Measured on SmolLM2-135M's decode step (8 rows, 30 layers, 120 of these linears a step; 2-core CPU): the
wrappers cost ~45 us a call outside the GEMM; docs/megatron-core-on-cpu.md has the step before and after.

`core.layer_spec.layer_spec` puts them wherever the local spec uses Megatron-Core's linears (not with emulated
FP8, whose linears are `core.fp8`'s; not in Transformer Engine's spec).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size


def _exchanges_nothing(layer) -> bool:
    """True where Megatron-Core's forward would communicate nothing: one tensor-parallel rank, no sequence
    parallelism, no expert communication."""
    return get_pg_size(layer.tp_group) == 1 and not layer.sequence_parallel and not layer.explicit_expert_comm


def _matmul(layer, input_: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron-Core's forward at TP=1 without autograd: matmul with the transposed weight, the bias added
    unless the layer hands it back (`skip_bias_add`, for a fused bias-dropout-add)."""
    output = torch.matmul(input_, weight.t())
    if layer.bias is not None and not layer.skip_bias_add:
        output = output + layer.bias
    return output, layer.bias if layer.skip_bias_add else None


class LeanColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` whose forward is one matmul where no gradient is recorded and TP=1 (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean = _exchanges_nothing(self)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        # A weight handed in (the output layer's tied embedding; not a layer-spec linear) goes through
        # Megatron-Core's forward, which checks its shape.
        if not self.lean or weight is not None or torch.is_grad_enabled():
            return super().forward(input_, weight, runtime_gather_output)
        return _matmul(self, input_, self.weight)


class LeanRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` whose forward is one matmul where no gradient is recorded and TP=1 (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean = _exchanges_nothing(self)

    def forward(self, input_):
        if not self.lean or torch.is_grad_enabled():
            return super().forward(input_)
        return _matmul(self, input_, self.weight)


LEAN = {ColumnParallelLinear: LeanColumnParallelLinear, RowParallelLinear: LeanRowParallelLinear}
