"""PyTorch implementations of the state-space kernels Megatron-Core's Mamba layers import from `mamba_ssm` (CUDA and
Triton only, so not installable on a CPU machine); `core.machine.compat` puts them in place where that package is
missing. They compute what `mamba_ssm`'s kernels compute (Mamba-2's state-space duality, Dao and Gu 2024), in fp32
whatever the inputs' dtype, as those kernels accumulate:

- `chunk_scan` is `mamba_chunk_scan_combined`: per chunk of `chunk_size` positions the quadratic (attention-like)
  form, between chunks the recurrence on the state, so a sequence of any length costs one pass over its chunks.
- `split_conv1d_scan` is `mamba_split_conv1d_scan_combined` without its fused norm and output projection (Megatron-Core
  runs those as layers of their own): the projection's output split into gate, convolved inputs and time steps, the
  causal depthwise convolution with SiLU, then `chunk_scan` gated by SiLU(gate).
- `GatedRMSNorm` is `mamba_ssm`'s gated RMSNorm (`layernorm_gated.RMSNorm`): RMS over groups of channels, the gate
  applied before (Mamba-2) or after the norm, with the sharded checkpoint entry Megatron-Core gives it.
- `l2norm` and `fla_causal_conv1d` are `fla`'s, which the gated DeltaNet takes (its delta rule is Megatron-Core's own
  PyTorch one, `torch_chunk_gated_delta_rule`).

A time step below `dt_limit`'s floor is raised to it, as `mamba_ssm` does; Megatron-Core passes no limit (0, inf).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NO_LIMIT = (0.0, float("inf"))


def chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
               cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT, return_final_states=False, **_unused):
    """y = SSM(x) over a batch of sequences: x [b, l, heads, head_dim], dt [b, l, heads], A [heads], B and C
    [b, l, groups, state]; D [heads] (or [heads, head_dim]) the skip connection, z [b, l, heads, head_dim] the gate
    (y * SiLU(z)); initial_states [b, heads, head_dim, state]. Returns y in x's dtype (and the final state in fp32)."""
    if seq_idx is not None or cu_seqlens is not None:
        raise NotImplementedError("packed sequences (seq_idx, cu_seqlens) in the PyTorch Mamba scan: pass one "
                                  "sequence per row (the cookbook's hybrid models refuse packing before launch).")
    batch, length, heads, head_dim = x.shape
    per_group = heads // B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_LIMIT:
        dt = dt.clamp(*dt_limit)
    B = B.float().repeat_interleave(per_group, dim=2)  # [b, l, heads, state]: each head reads its group's
    C = C.float().repeat_interleave(per_group, dim=2)
    xf = x.float()
    pad = (-length) % chunk_size  # a time step of 0 past the end: no decay, no input, the state carried as it is
    if pad:
        xf, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (length + pad) // chunk_size
    xc = xf.view(batch, chunks, chunk_size, heads, head_dim)
    Bc = B.view(batch, chunks, chunk_size, heads, -1)
    Cc = C.view(batch, chunks, chunk_size, heads, -1)
    dtc = dt.view(batch, chunks, chunk_size, heads)
    decay = (dtc * A.float()).cumsum(dim=2)  # [b, c, q, heads]: log of the decay from the chunk's start
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    pairwise = (decay.unsqueeze(3) - decay.unsqueeze(2)).masked_fill(~causal[:, :, None], float("-inf")).exp()
    scores = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc) * pairwise  # position i reading position j <= i
    y = torch.einsum("bcijh,bcjh,bcjhp->bcihp", scores, dtc, xc)
    to_end = (decay[:, :, -1:] - decay).exp() * dtc  # each position's input carried to its chunk's end
    chunk_states = torch.einsum("bcjh,bcjhn,bcjhp->bchpn", to_end, Bc, xc)
    state = (initial_states.float() if initial_states is not None
             else x.new_zeros(batch, heads, head_dim, Bc.shape[-1], dtype=torch.float32))
    carried = []
    for c in range(chunks):  # the state entering each chunk, read by its positions with their decay so far
        carried.append(torch.einsum("bihn,bhpn,bih->bihp", Cc[:, c], state, decay[:, c].exp()))
        state = state * decay[:, c, -1].exp()[:, :, None, None] + chunk_states[:, c]
    y = (y + torch.stack(carried, dim=1)).reshape(batch, chunks * chunk_size, heads, head_dim)[:, :length]
    if D is not None:
        y = y + xf[:, :length] * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = "silu"):
    """Depthwise causal convolution over [b, l, channels] with weight [channels, width]: position t sees t - width + 1
    .. t, zeros before the start (causal_conv1d's `causal_conv1d_fn`, channels last)."""
    width = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    out = out[..., : x.shape[1]].transpose(1, 2)
    return F.silu(out) if activation in ("silu", "swish") else out


def split_conv1d_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                      seq_idx=None, dt_limit=NO_LIMIT, return_final_states=False, activation="silu",
                      rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                      ngroups=1, norm_before_gate=True, **_unused):
    """The Mamba-2 mixer between its input projection's output [b, l, z | x B C | dt] and its norm: SiLU(gate) *
    SSM(conv(x B C)), [b, l, heads x head_dim]."""
    if rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("the fused norm and output projection: Megatron-Core runs them as layers")
    heads = dt_bias.shape[0]
    head_dim = headdim if headdim is not None else D.shape[-1]
    inner = heads * head_dim
    state = (zxbcdt.shape[-1] - 2 * inner - heads) // (2 * ngroups)
    z, xbc, dt = zxbcdt.split([inner, inner + 2 * ngroups * state, heads], dim=-1)
    xbc = causal_conv(xbc, conv1d_weight, conv1d_bias, activation)
    x, b, c = xbc.split([inner, ngroups * state, ngroups * state], dim=-1)
    batch, length = zxbcdt.shape[:2]
    out = chunk_scan(x.reshape(batch, length, heads, head_dim), dt, A, b.reshape(batch, length, ngroups, state),
                     c.reshape(batch, length, ngroups, state), chunk_size, D=D,
                     z=z.reshape(batch, length, heads, head_dim), dt_bias=dt_bias, initial_states=initial_states,
                     seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, return_final_states=return_final_states)
    if return_final_states:
        return out[0].reshape(batch, length, inner), out[1]
    return out.reshape(batch, length, inner)


class GatedRMSNorm(torch.nn.Module):
    """`mamba_ssm`'s gated RMSNorm: x (times SiLU(z) before the norm unless `norm_before_gate`) normalised by its RMS
    over each group of `group_size` channels, times the weight (times SiLU(z) after, if `norm_before_gate`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        h = x.float()
        if z is not None and not self.norm_before_gate:
            h = h * F.silu(z.float())
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        h = h * self.weight.float()
        if z is not None and self.norm_before_gate:
            h = h * F.silu(z.float())
        return h.to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Split along its channels over tensor parallelism, as Megatron-Core's `ExtendedRMSNorm`."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum of squares + eps) over `dim`: `fla`'s l2norm (the gated DeltaNet's queries and keys)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def fla_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, **_unused):
    """`fla`'s `causal_conv1d` ([b, s, channels] in and out, weight [channels, width]): `causal_conv` with its calling
    convention, returning (y, None)."""
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise NotImplementedError("the PyTorch causal convolution runs whole unpacked sequences from a zero state")
    return causal_conv(x, weight, bias, activation), None
