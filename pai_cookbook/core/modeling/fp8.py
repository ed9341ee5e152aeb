"""FP8 numerics where there are no FP8 tensor cores: Transformer Engine's scaling recipes, emulated.

On a GPU of compute capability >= 8.9 with Transformer Engine the cookbook runs real FP8 GEMMs (TE's layer
spec with Megatron-Core's own fp8 fields). Everywhere else, the emulated backend reproduces the *numerics*
a recipe gives an FP8 GEMM: each operand is multiplied by its scale, saturated at the format's largest finite
value (TE casts with "satfinite"), rounded to the format (torch's float8 dtypes round to nearest even) and
divided by the scale again; the GEMM then runs in fp32 on those values. It models rounding, range and
scaling; it does not model tensor-core accumulation order or speed, and every report labels it "emulated".

The scaling recipes, as Transformer Engine defines them:
- delayed: per tensor, an amax history of `history` steps. A step uses the scale computed after the previous
  one; after the step its amax enters slot 0, the group's maximum is taken (all-reduce MAX), the new scale is
  fp8_max / amax / 2**margin from the history's max (or its most recent entry), the old scale is kept when
  that amax is 0 or not finite, and the history rolls.
- tensorwise ("current scaling"): the scale comes from this very tensor's amax, reduced over the group.
- blockwise: one power-of-two scale per 1 x 128 block of activations and gradients (along the GEMM's inner
  dimension) and per 128 x 128 block of weights, from that block's own amax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}
# Where rounding ends and saturation begins: the largest finite value plus half its unit in the last place
# (448 + 32/2, 57344 + 8192/2). Below it, round-to-nearest gives the largest finite value anyway (a value at
# the amax, scaled by fp8_max / amax, lands a rounding error above fp8_max); above it the clamp lost range.
SATURATES_ABOVE = {"e4m3": 464.0, "e5m2": 61440.0}
BLOCK = 128


@dataclass
class Counts:
    """What one quantization did: the tensor's amax, the scale used, saturated and flushed-to-zero values."""

    amax: float = 0.0
    scale: float = 1.0
    overflow: int = 0
    underflow: int = 0
    numel: int = 0

    def merge(self, other: Counts) -> None:
        self.amax = max(self.amax, other.amax)
        self.scale, self.numel = other.scale, self.numel + other.numel
        self.overflow += other.overflow
        self.underflow += other.underflow


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str,
             amax: float | None = None) -> tuple[torch.Tensor, Counts]:
    """`x` as an FP8 GEMM sees it: x * scale saturated at the format's max, rounded, divided by scale (fp32).

    `scale` is a scalar or broadcasts against `x` (blockwise); `amax` is x's largest magnitude when the
    caller has it. Overflow counts the values that saturated (beyond rounding distance of the largest
    finite value); underflow the non-zero values that rounded to zero.
    """
    dtype, fmax = FORMATS[fmt]
    scaled = x.float() * scale
    if amax is None:
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
    peak = amax * float(scale.max() if torch.is_tensor(scale) else scale)
    overflow = 0
    if not peak <= SATURATES_ABOVE[fmt]:  # the pass over x only when something can saturate (or is inf/NaN)
        overflow = int((scaled.abs() > SATURATES_ABOVE[fmt]).sum())  # NaN stays NaN, as TE's cast leaves it
    rounded = scaled.clamp(-fmax, fmax).to(dtype).float()
    # rounding never makes a zero non-zero, nor saturation a value zero: the difference is what underflowed
    underflow = int(torch.count_nonzero(x)) - int(torch.count_nonzero(rounded))
    scalar = float(scale) if not torch.is_tensor(scale) or scale.numel() == 1 else float("nan")
    counts = Counts(amax=amax, scale=scalar, overflow=overflow, underflow=underflow, numel=x.numel())
    return rounded / scale, counts


def scale_from_amax(amax: torch.Tensor, old_scale: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """Transformer Engine's rule: fp8_max / amax / 2**margin, the old scale where amax is 0 or not finite."""
    fmax = FORMATS[fmt][1]
    new = (fmax / amax) / (2.0 ** margin)
    new = torch.where(amax > 0, new, old_scale)
    return torch.where(torch.isfinite(amax), new, old_scale)


@dataclass
class DelayedScaling:
    """One tensor's delayed-scaling state: its amax history and the scale the next step uses."""

    fmt: str
    history: int = 1024
    algorithm: str = "max"  # or "most_recent"
    margin: int = 0
    amax_history: torch.Tensor = field(init=False)
    scale: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.amax_history = torch.zeros(self.history)
        self.scale = torch.ones(())  # TE starts every tensor at scale 1

    def record(self, amax: torch.Tensor) -> None:
        """This step's amax (already reduced over the group) into slot 0, as TE writes it during the step."""
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.float().reshape(()))

    def update(self) -> None:
        """After the step: the next scale from the history (max or most recent), then roll the history."""
        amax = self.amax_history.max() if self.algorithm == "max" else self.amax_history[0].clone()
        if self.history > 1:
            self.amax_history = torch.roll(self.amax_history, -1, 0)
        self.amax_history[0] = 0.0
        self.scale = scale_from_amax(amax, self.scale, self.fmt, self.margin)


def current_scale(amax: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """Tensorwise (current) scaling: from this tensor's own amax; 1 for an all-zero tensor."""
    return scale_from_amax(amax.float(), torch.ones_like(amax, dtype=torch.float32), fmt, margin)


def block_scales(x: torch.Tensor, fmt: str, weight: bool) -> torch.Tensor:
    """Blockwise scales broadcastable against 2-D `x`: one per 1 x 128 block along the last dimension (128 x 128
    for a weight), each a power of two at or below fp8_max / block amax (1 for an all-zero block)."""
    rows, cols = x.shape
    pad_rows = (-rows) % BLOCK if weight else 0
    padded = torch.nn.functional.pad(x.detach().float().abs(), (0, (-cols) % BLOCK, 0, pad_rows))
    r = padded.shape[0] // BLOCK if weight else padded.shape[0]
    blocks = padded.reshape(r, BLOCK if weight else 1, padded.shape[1] // BLOCK, BLOCK)
    amax = blocks.amax(dim=(1, 3))  # [row blocks, column blocks]
    scale = torch.exp2(torch.floor(torch.log2(current_scale(amax, fmt))))
    scale = scale.repeat_interleave(BLOCK if weight else 1, 0).repeat_interleave(BLOCK, 1)
    return scale[:rows, :cols]


def representable(fmt: str) -> torch.Tensor:
    """Every finite value of the format, ascending (both zeros once)."""
    dtype = FORMATS[fmt][0]
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.unique(values[torch.isfinite(values)])


def ulp_bound(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half the gap between the two representable values around each x (inside the format's range)."""
    grid = representable(fmt)
    hi = torch.searchsorted(grid, x.float()).clamp(1, len(grid) - 1)
    return (grid[hi] - grid[hi - 1]) / 2


# --------------------------------------------------------------------------------------------------
# The emulated FP8 linear layer
# --------------------------------------------------------------------------------------------------
ROLES = ("input", "weight", "grad")


class EmulatedGemm:
    """The FP8 state of one linear layer: a scaling state per operand role, and what quantizing did since
    the last `collect`. Not an nn.Module: checkpoints are the same with and without FP8."""

    def __init__(self, fp8) -> None:  # fp8: config.FP8Config
        self.recipe = fp8.recipe
        self.margin = fp8.margin
        self.formats = {"input": "e4m3", "weight": "e4m3", "grad": "e5m2" if fp8.format == "hybrid" else "e4m3"}
        self.delayed = ({role: DelayedScaling(self.formats[role], fp8.amax_history_len, fp8.amax_compute_algo,
                                              fp8.margin) for role in ROLES} if fp8.recipe == "delayed" else {})
        self.counts = {role: Counts() for role in ROLES}
        self.enabled = True

    def quantize(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """x as this layer's FP8 GEMM sees it (fp32), with the role's scale; updates the scaling state."""
        fmt = self.formats[role]
        if self.recipe == "blockwise":
            flat = x.reshape(-1, x.shape[-1])
            scale = block_scales(flat, fmt, weight=role == "weight")
            out, counts = quantize(flat, scale, fmt)
            out = out.reshape(x.shape)
        else:
            # The scale is one for the whole tensor, however TP splits it: amax is reduced over TP x DP (x CP),
            # Transformer Engine's amax reduction group, so TP=2 quantizes exactly as TP=1 does.
            amax = x.detach().abs().max().float() if x.numel() else torch.zeros(())
            _reduce_max(amax)
            if self.recipe == "delayed":
                state = self.delayed[role]
                out, counts = quantize(x, state.scale, fmt, float(amax))
                state.record(amax)
                state.update()
            else:
                out, counts = quantize(x, current_scale(amax, fmt, self.margin), fmt, float(amax))
        self.counts[role].merge(counts)
        return out

    def collect(self) -> dict[str, dict[str, float]]:
        """Per role since the last call: amax, the last scale, overflow and underflow fractions (over TP)."""
        out = {}
        for role, c in self.counts.items():
            totals = torch.tensor([c.overflow, c.underflow, c.numel], dtype=torch.float64)
            _reduce_sum_tp(totals)
            n = max(float(totals[2]), 1.0)
            out[role] = {"amax": c.amax, "scale": c.scale, "overflow": float(totals[0]) / n,
                         "underflow": float(totals[1]) / n}
        self.counts = {role: Counts() for role in ROLES}
        return out


def _all_reduce(t: torch.Tensor, group_of, op=torch.distributed.ReduceOp.SUM) -> None:
    """All-reduce `t` in place over `group_of(parallel_state)`; nothing outside a distributed run."""
    from megatron.core import parallel_state

    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
        group = group_of(parallel_state)
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(t, op=op, group=group)


def _reduce_max(t: torch.Tensor) -> None:
    _all_reduce(t, lambda ps: ps.get_amax_reduction_group(with_context_parallel=True), torch.distributed.ReduceOp.MAX)


def _reduce_sum_tp(t: torch.Tensor) -> None:
    _all_reduce(t, lambda ps: ps.get_tensor_model_parallel_group())


class _QuantizeOperand(torch.autograd.Function):
    """Forward: the operand quantized (fp32). Backward: the gradient passes through, in the operand's dtype
    (the GEMM's own backward already multiplies by the other *quantized* operand, as an FP8 GEMM does)."""

    @staticmethod
    def forward(ctx, x, gemm, role):
        ctx.dtype = x.dtype
        return gemm.quantize(role, x)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None, None


class _QuantizeGradient(torch.autograd.Function):
    """Forward: identity. Backward: the output gradient quantized (e5m2 with the hybrid format)."""

    @staticmethod
    def forward(ctx, y, gemm):
        ctx.gemm = gemm
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.gemm.quantize("grad", grad.float()), None


def emulated_linear(base: type, fp8) -> type:
    """`base` (Megatron-Core's ColumnParallelLinear or RowParallelLinear) with FP8 GEMM numerics: input and
    weight quantized in forward, the output gradient in backward, the GEMMs in fp32 on the quantized values.
    Tensor-parallel communication stays Megatron-Core's own."""

    class EmulatedFP8Linear(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fp8_gemm = EmulatedGemm(fp8)

        def _forward_impl(self, input, weight, *args, **kwargs):
            gemm = self.fp8_gemm
            if not gemm.enabled:
                return super()._forward_impl(input, weight, *args, **kwargs)
            bias = kwargs.get("bias")
            if bias is not None:
                kwargs["bias"] = bias.float()
            out = super()._forward_impl(_QuantizeOperand.apply(input, gemm, "input"),
                                        _QuantizeOperand.apply(weight, gemm, "weight"), *args, **kwargs)
            return _QuantizeGradient.apply(out, gemm).to(input.dtype)

    EmulatedFP8Linear.__name__ = f"EmulatedFP8{base.__name__}"
    EmulatedFP8Linear.__qualname__ = EmulatedFP8Linear.__name__
    return EmulatedFP8Linear


def emulated_linears(fp8) -> dict[type, type]:
    """Megatron-Core's parallel linears -> their versions with `fp8`'s (an FP8Config's) emulated numerics, for
    `core.modeling.specs.swap_classes`. Embedding and output layer are not in a layer spec: they stay bf16."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return {ColumnParallelLinear: emulated_linear(ColumnParallelLinear, fp8),
            RowParallelLinear: emulated_linear(RowParallelLinear, fp8)}


def emulated_gemms(module: torch.nn.Module) -> dict[str, EmulatedGemm]:
    """name -> FP8 state of every emulated linear in `module`."""
    return {name: m.fp8_gemm for name, m in module.named_modules() if hasattr(m, "fp8_gemm")}


def keep_layers_in_bf16(chunks, first: int, last: int, num_layers: int) -> None:
    """first_last_layers_bf16: switch FP8 off in the first `first` and last `last` transformer layers."""
    for chunk in chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            if layer.layer_number <= first or layer.layer_number > num_layers - last:
                for gemm in emulated_gemms(layer).values():
                    gemm.enabled = False


def collect(chunks) -> dict[str, dict[str, dict[str, float]]]:
    """Per emulated linear and role, what quantizing did since the last call. A linear is named by its
    transformer layer's global number (1-based, the same at every PP layout) and its place in the layer:
    "1.self_attention.linear_qkv", "2.mlp.experts.local_experts.0.linear_fc1"."""
    out = {}
    for chunk in chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            for name, gemm in emulated_gemms(layer).items():
                if gemm.enabled:
                    out[f"{layer.layer_number}.{name}"] = gemm.collect()
    return out
