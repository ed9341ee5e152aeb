"""Megatron-Core's transformer layer and self-attention with a short forward where nothing is recorded for backward.

`TransformerLayer.forward` and `Attention.forward` serve every feature Megatron-Core has: recomputation and
activation offloading (a context manager around each norm and linear), NVTX ranges (a push and a pop around each
step), cross-attention (three identity modules called on every self-attention layer), fused tensor-parallel
inference kernels, flash decoding, CUDA graphs, packed sequences, output gates. A SmolLM2-135M decode step (8 rows,
30 layers) made 10,200 Python calls in the cookbook against 6,000 in transformers' Llama for 2,100 against 2,400
ATen ops (docs/megatron-core-on-cpu.md): the difference is that scaffolding, a few microseconds a call on a CPU.

Where no gradient is recorded, the module is in eval mode and none of those features is on, the classes here run
the same submodules with the same ops in the same order and nothing else, so the outputs are bitwise the same:
- the layer: input norm, self-attention, bias-dropout-add (in eval mode Megatron-Core's adds the bias and the
  residual in place; dropout is the identity), the pre-MLP norm, the MLP (Megatron-Core's dense MLP is run as its
  linears and its activation, a mixture of experts through its own module), bias-dropout-add;
- self-attention: Megatron-Core's own `get_query_key_value_tensors` and `_adjust_key_value_for_inference` (the KV
  cache; `core.modeling.attention`'s rotated keys), its `apply_rotary_pos_emb` on the queries (and keys without a cache),
  the core attention module, the output projection.
Anything else (training, gradients on, TP > 1, sequence parallelism, packed sequences, Transformer Engine's spec)
is Megatron-Core's forward, unchanged. Used by generation, RL rollouts, scoring and evaluation.

`pai_cookbook.cpu.convert_spec` builds layers from `lean_layer_class` and self-attention as
`cpu.attention.LeanSelfAttention`, which calls `attention_forward` here, on the CPU path only
(`core.machine.build.CPU_CONVERTERS`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _bias_dropout_add(output: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """Megatron-Core's bias-dropout-add in eval mode with nothing requiring a gradient (`_bias_dropout_add_func`,
    in place): the bias added to the output, then the residual; dropout is the identity."""
    if residual.dtype != output.dtype:
        residual = residual.to(output.dtype)
    if bias is not None:
        output.add_(bias)
    return output.add_(residual)


def _dense_mlp(mlp, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
    """Megatron-Core's `MLP.forward` without fused activations (the local spec on CPU): fc1, bias, the activation
    (gated: `activation(first half) * (second half + glu_linear_offset)`, clamped where configured), fc2."""
    config = mlp.config
    intermediate, bias = mlp.linear_fc1(hidden)
    if bias is not None:
        intermediate = intermediate + bias
    if config.gated_linear_unit:
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        intermediate = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        intermediate = config.activation_func(intermediate)
    return mlp.linear_fc2(intermediate)


def _short_mlp(layer) -> bool:
    """True where the layer's MLP is Megatron-Core's dense `MLP` (adopted as a `GatedMLP`) with its activation
    unfused."""
    from pai_cookbook.cpu.glu import GatedMLP

    config = layer.config
    return type(layer.mlp) is GatedMLP and not config.use_te_activation_func and not config.bias_activation_fusion


def _short_layer(layer) -> bool:
    """True where `TransformerLayer.forward` in eval mode does nothing but norms, attention, MLP and residuals."""
    from megatron.core.transformer.identity_op import IdentityOp

    config = layer.config
    return not (layer.recompute_input_layernorm or layer.recompute_pre_mlp_layernorm or layer.recompute_mlp
                or layer.offload_attn_norm or layer.offload_mlp_norm or config.inference_fuse_tp_communication
                or config.mlp_chunks_for_prefill > 1 or not isinstance(layer.cross_attention, IdentityOp)
                or not isinstance(layer.pre_cross_attn_layernorm, IdentityOp))


def lean_layer_class(base):
    """`base` (a `TransformerLayer`) with the short forward of the module doc where nothing needs more, its dense
    MLP adopted as a `cpu.glu.GatedMLP`."""
    from megatron.core.transformer.mlp import MLP

    from pai_cookbook.cpu.glu import GatedMLP

    class LeanTransformerLayer(base):
        lean_converted = True  # `cpu.convert_spec` converts a layer spec once

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if type(self.mlp) is MLP:
                GatedMLP.adopt(self.mlp)
            self.lean = _short_layer(self)
            self.lean_mlp = _short_mlp(self)

        def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                    rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                    inference_context=None, packed_seq_params=None, sequence_len_offset=None, padding_mask=None,
                    **kwargs):
            if (not self.lean or self.training or torch.is_grad_enabled() or kwargs.get("inference_params")
                    is not None):
                return super().forward(
                    hidden_states, attention_mask=attention_mask, context=context, context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                    rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                    inference_context=inference_context, packed_seq_params=packed_seq_params,
                    sequence_len_offset=sequence_len_offset, padding_mask=padding_mask, **kwargs)
            output, bias = self.self_attention(
                self.input_layernorm(hidden_states), attention_mask=attention_mask, inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)
            hidden_states = _bias_dropout_add(output, bias, hidden_states)
            normed = self.pre_mlp_layernorm(hidden_states)
            if self.lean_mlp and not self.mlp._forward_hooks:  # a hooked MLP (Gemma's post-norm) is called
                output, bias = _dense_mlp(self.mlp, normed)
            else:
                output, bias = self.mlp(normed, padding_mask=padding_mask)
            return _bias_dropout_add(output, bias, hidden_states), context

    LeanTransformerLayer.__name__ = LeanTransformerLayer.__qualname__ = f"Lean{base.__name__}"
    return LeanTransformerLayer


def short_attention(attention) -> bool:
    """True where `attention` (a `SelfAttention` of the local spec at TP=1) can take `attention_forward`; checked
    once, at build time (what changes per call is checked in `attention_forward`'s caller)."""
    from pai_cookbook.cpu.linear import LeanColumnParallelLinear

    config = attention.config
    return (isinstance(attention.linear_qkv, LeanColumnParallelLinear) and attention.linear_qkv.lean
            and not config.flash_decode and not config.attention_output_gate and not config.no_rope_freq
            and not config.apply_rope_fusion and not config.fused_single_qkv_rope and not config.test_mode
            and not attention.offload_qkv_linear and not attention.offload_attn_proj)


def rotates_whole_heads(attention, rotary_pos_emb) -> bool:
    """True where Megatron-Core would rotate queries and keys with one table, over the whole head, unfused and not
    interleaved: the case `attention_forward` rotates with `core.modeling.attention.step_rotation`'s tables."""
    config = attention.config
    q_pos_emb, k_pos_emb = rotary_pos_emb
    return (q_pos_emb is k_pos_emb and q_pos_emb.shape[-1] == attention.hidden_size_per_attention_head
            and not config.rotary_interleaved and not config.multi_latent_attention)


def attention_forward(attention, hidden_states: Tensor, attention_mask: Tensor | None, inference_context,
                      rotary_pos_emb) -> tuple[Tensor, Tensor | None]:
    """`Attention.forward` of a static-batching (or no) inference context, with nothing but its computation: the
    caller has checked `short_attention`, eval mode, no gradient, no packed sequences, no attention bias, no
    separate rotary cos/sin.

    In a static context the queries and the new keys are rotated before the keys are stored (as
    `core.modeling.attention.LeftPaddedSelfAttention` does) with the step's cos and sin, made once for every layer
    (`core.modeling.attention.step_rotation`): `t * cos + rotate_half(t) * sin`, Megatron-Core's `_apply_rotary_pos_emb_bshd`
    on the same tables, whose last `torch.cat` with an empty pass-through part copies the same values."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

    from pai_cookbook.core.modeling.attention import rotate, step_rotation

    if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = (rotary_pos_emb,) * 2
    query, key, value = attention.get_query_key_value_tensors(hidden_states, None, split_qkv=True, output_gate=False)
    config = attention.config
    if (rotary_pos_emb is not None and inference_context is not None
            and rotates_whole_heads(attention, rotary_pos_emb)):
        cos, sin = step_rotation(inference_context, rotary_pos_emb[0], key.size(1), key.size(0),
                                 _yarn_get_concentration_factor_from_config(config), key.dtype)
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
        rotary_pos_emb = None  # applied: the cache stores these keys as they are
    query, key, value, rotary_pos_emb, mask_type, _ = attention._adjust_key_value_for_inference(
        inference_context, query, key, value, rotary_pos_emb)
    if rotary_pos_emb is not None:
        cp_group = attention.pg_collection.cp
        mscale = _yarn_get_concentration_factor_from_config(config)
        q_pos_emb, k_pos_emb = rotary_pos_emb
        if q_pos_emb is not None:
            query = apply_rotary_pos_emb(query, q_pos_emb, config=config, mscale=mscale, cp_group=cp_group)
        if k_pos_emb is not None:
            key = apply_rotary_pos_emb(key, k_pos_emb, config=config, mscale=mscale, cp_group=cp_group)
    core = attention.core_attention(query, key, value, attention_mask, attn_mask_type=mask_type,
                                    attention_bias=None, packed_seq_params=None)
    return attention.linear_proj(core)
