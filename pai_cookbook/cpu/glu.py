"""Megatron-Core's dense MLP with SwiGLU computed by one autograd function (local spec).

Without fused activations (the local spec: every CPU run) `MLP.forward` computes SwiGLU as autograd records it:
fc1's output chunked into a gate and a linear half, `silu(gate) * (linear + glu_linear_offset)`. Its backward
makes each half's gradient as a tensor of its own and `torch.chunk`'s backward then copies both into one for fc1,
and the forward's `linear + 0.0` copies the linear half: on the benchmark model (8 x 256 rows, 1,376 wide) a copy
of 22 MB and one of 11 MB a layer, each step.

`swiglu` is the same arithmetic with the gradients written where fc1's backward reads them: the linear half's
`grad * silu(gate)` and the gate half's `silu_backward(grad * linear, gate)` (autograd's formulas for a product and
for SiLU), each into its half of one tensor. Every element is the same product or the same SiLU derivative as
before, so values and gradients are the same bit for bit (tests/test_train.py); it keeps fewer tensors for
backward (fc1's output and the SiLU, where autograd kept those and the offset copy).

`GatedMLP` is Megatron-Core's `MLP` calling it where `MLP.forward` would compute exactly that: SiLU, gated, no
offset, no clamp, no fused or Transformer Engine activation, no per-token scale (an expert's). Anything else is
`MLP.forward`. The CPU path's layers (`cpu.lean_layer`) adopt their dense `MLP` as one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, intermediate: torch.Tensor) -> torch.Tensor:
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(gate, linear, activated)
        return activated * linear

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate, linear, activated = ctx.saved_tensors
        grad_input = grad.new_empty(*gate.shape[:-1], 2 * gate.shape[-1])
        grad_gate, grad_linear = torch.chunk(grad_input, 2, dim=-1)
        torch.mul(grad, activated, out=grad_linear)
        torch.ops.aten.silu_backward.grad_input(grad * linear, gate, grad_input=grad_gate)
        return grad_input


def swiglu(intermediate: torch.Tensor) -> torch.Tensor:
    """`silu(first half) * second half` of the last dimension, its backward writing one gradient tensor."""
    return _SwiGLU.apply(intermediate)


class GatedMLP(MLP):
    """Megatron-Core's `MLP` with SwiGLU by `swiglu` where `MLP.forward` would compute the same (module doc)."""

    plain_swiglu = False

    @classmethod
    def adopt(cls, mlp: MLP) -> MLP:
        """`mlp`, as Megatron-Core's layer built it (its process groups, its parameters), made a `GatedMLP`.

        Adopted rather than built from the spec: `TransformerLayer` hands the tensor-parallel group to the spec's
        `MLP` only, and would build a subclass with the default one and a warning."""
        mlp.__class__ = cls
        config = mlp.config
        mlp.plain_swiglu = (config.gated_linear_unit and mlp.activation_func is F.silu
                            and config.activation_func_clamp_value is None and config.glu_linear_offset == 0.0
                            and not config.use_te_activation_func and not config.bias_activation_fusion)
        return mlp

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.plain_swiglu or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))
