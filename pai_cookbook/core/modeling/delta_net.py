"""Qwen3-Next's linear attention: Megatron-Core's gated DeltaNet layer (`ssm.gated_delta_net.GatedDeltaNet`) as the
local hybrid stack builds it (`core.modeling.hybrid`), with what upstream's lacks:

- Generation. Upstream raises on any inference context. `LeftPaddedGatedDeltaNet` runs a static batch with a state
  per row: the causal convolution's last inputs and the delta rule's recurrent state, kept in the context beside the
  attention layers' KV cache; a prompt is one step of the same computation as a new token, so the two cannot drift.
  A left-padded row's padding enters as zeros (what transformers does with the attention mask), so its state starts at
  its first real token from zero, as it would alone.
- One seed, one model (`draw_whole`): the input projection `[q, k, v, z, beta, alpha]` is one column-parallel weight
  whose own initialisation splits its rows in one piece, and the convolution and A are drawn per TP rank; drawn
  whole and split per part, TP=2 builds the model TP=1 does.
- Its output norm (`HeadNorm`): plain w over each value head, which the (1 + w) swap of the model's other norms must
  not take (`core.modeling.gemma`).
The kernels are `fla`'s on a GPU; where it is missing (a CPU) `core.machine.compat` puts PyTorch's in their place.
"""

from __future__ import annotations

import math

import torch

from pai_cookbook.core.modeling.gemma import PlusOneRMSNorm


class HeadNorm(PlusOneRMSNorm):
    """RMSNorm with a plain weight (starting at one) over each head, replicated over TP ranks: the gated DeltaNet's
    output norm (transformers' `Qwen3NextRMSNormGated` before its gate: the weight times the input's dtype)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rank_parts(whole: torch.Tensor, sizes: list[int], tp: int, rank: int) -> torch.Tensor:
    """This TP rank's rows of a tensor stacked from parts of `sizes` rows, each part split over TP on its own (a fused
    projection or convolution of several parts, as Megatron-Core lays one out per rank)."""
    return torch.cat([part.chunk(tp)[rank] for part in whole.split(sizes)])


def draw_whole(gdn, generator: torch.Generator) -> None:
    """The layer's parameters TP splits per part drawn for the whole model as upstream draws them (the projection
    normal with the init std, the convolution Kaiming-uniform as `nn.Conv1d`'s, A uniform in [1, 16]; dt_bias is ones),
    this rank's rows taken from each part; and the output projection whole with upstream's init method, this rank's
    columns taken (upstream draws it after the convolution, whose per-rank draw moved the stream it came from)."""
    tp, rank = gdn.tp_size, gdn.pg_collection.tp.rank()
    qk, v, heads = gdn.qk_dim, gdn.v_dim, gdn.num_value_heads
    projection = torch.empty(2 * qk + 2 * v + 2 * heads, gdn.hidden_size).normal_(
        0.0, gdn.config.init_method_std, generator=generator)
    conv = torch.empty(2 * qk + v, 1, gdn.conv_kernel_dim)
    torch.nn.init.kaiming_uniform_(conv, a=math.sqrt(5), generator=generator)
    a = torch.empty(heads).uniform_(*gdn.A_init_range, generator=generator)

    def rows(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return rank_parts(t, sizes, tp, rank)

    out = torch.empty(gdn.hidden_size, v)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator)))
        gdn.config.output_layer_init_method(out)
    with torch.no_grad():
        gdn.out_proj.weight.copy_(out.chunk(tp, dim=1)[rank].to(gdn.out_proj.weight.dtype))
        gdn.in_proj.weight.copy_(rows(projection, [qk, qk, v, v, heads, heads]).to(gdn.in_proj.weight.dtype))
        gdn.conv1d.weight.copy_(rows(conv, [qk, qk, v]).to(gdn.conv1d.weight.dtype))
        gdn.A_log.copy_(rows(torch.log(a), [heads]).to(gdn.A_log.dtype))


def layer_class():
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet

    from pai_cookbook.core.modeling.attention import padding_of

    class LeftPaddedGatedDeltaNet(GatedDeltaNet):
        """Upstream's gated DeltaNet, and a static-batching generation step (module doc)."""

        def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                    sequence_len_offset=None, *, inference_params=None, **kwargs):
            context = inference_context if inference_context is not None else inference_params
            if context is None:
                return super().forward(hidden_states, attention_mask, None, packed_seq_params, sequence_len_offset,
                                       **kwargs)
            if not context.is_static_batching() or self.cp_size > 1 or self.config.sequence_parallel:
                raise NotImplementedError("the gated DeltaNet generates in a static batch, without context or "
                                          "sequence parallelism")
            return self._step(hidden_states, context)

        def _states(self, context, rows: int):
            """(the convolution's last inputs [b, channels, width - 1], the recurrent state [b, heads, dk, dv] in
            fp32) of this layer in `context`, zeroed at a batch's first step."""
            states = context.key_value_memory_dict.get(self.layer_number)
            if states is None or states[0].size(0) != rows:
                device = self.in_proj.weight.device
                states = (torch.zeros(rows, self.conv_dim_local_tp, self.conv_kernel_dim - 1, device=device,
                                      dtype=self.in_proj.weight.dtype),
                          torch.zeros(rows, self.num_v_heads_local_tp, self.key_head_dim, self.value_head_dim,
                                      device=device, dtype=torch.float32))
                context.key_value_memory_dict[self.layer_number] = states
            elif context.sequence_len_offset == 0:
                for state in states:
                    state.zero_()
            return states

        def _step(self, hidden_states, context):
            length, rows, _ = hidden_states.shape
            conv_state, recurrent = self._states(context, rows)
            padding = padding_of(context, rows)
            if padding is not None:  # the padding's inputs are zeros: [s, b, 1]
                start = context.sequence_len_offset
                positions = torch.arange(start, start + length, device=hidden_states.device)[:, None]
                hidden_states = hidden_states * (positions >= padding[None, :])[..., None]
            projected, _ = self.in_proj(hidden_states)
            qkv, gate, beta, alpha = projected.transpose(0, 1).split(self.feat_dim_split, dim=-1)
            window = torch.cat([conv_state.transpose(1, 2), qkv], dim=1)  # [b, width - 1 + s, channels]
            conv_state.copy_(window[:, -(self.conv_kernel_dim - 1):].transpose(1, 2))
            qkv = torch.nn.functional.conv1d(window.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                                             groups=self.conv_dim_local_tp)
            qkv = self.act_fn(qkv).transpose(1, 2)
            gate = gate.reshape(rows, length, -1, self.value_head_dim)
            query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
                qkv, gate, rows, length, beta, alpha)
            g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
            out, state = self.gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=recurrent,
                                               output_final_state=True, use_qk_l2norm_in_kernel=False)
            recurrent.copy_(state)
            normed = self._apply_gated_norm(out, gate).reshape(rows, length, -1).transpose(0, 1).contiguous()
            return self.out_proj(normed)

    return LeftPaddedGatedDeltaNet
