"""The CPU path's self-attention (`core.machine.build.CPU_CONVERTERS["lean_attention"]`): the local path's
`LeftPaddedSelfAttention` with two shortcuts that compute the same values bit for bit.

- Where no gradient is recorded on the local spec at TP=1 (generation, rollouts, scoring), the forward is
  `cpu.lean_layer.attention_forward`: Megatron-Core's calls without its scaffolding for features that are off.
- Without an inference context (training, scoring with gradients) on unpacked rows, where Megatron-Core would rotate
  queries and keys with one table over whole heads, unfused and not interleaved, they are rotated by
  `core.modeling.attention.rotate` right after the projection (in `_adjust_key_value_for_inference`, which `Attention.forward`
  calls between the two) and `Attention.forward` is handed no embedding to apply: the same elementwise products and
  sums, so the same values and gradients bit for bit, without two copies of the queries and keys a layer forward
  and three backward (tests/test_train.py).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention, _yarn_get_concentration_factor_from_config

from pai_cookbook.core.modeling.attention import LeftPaddedSelfAttention, left_padding_mask, rotate, rotation_tables
from pai_cookbook.cpu import lean_layer


class LeanSelfAttention(LeftPaddedSelfAttention):
    """`LeftPaddedSelfAttention` with the CPU path's shortcuts (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean = lean_layer.short_attention(self)
        config = self.config
        # interleaved rotation and multi-latent attention: `lean_layer.rotates_whole_heads`, asked per call
        self.rotates_unfused = not (config.apply_rope_fusion or config.fused_single_qkv_rope or config.flash_decode)
        self._rotate_after_projection = False  # set by forward for the call in progress

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        # Megatron-Core 0.16's `Attention.forward` signature, spelt out so that the short forward's conditions
        # are plain comparisons (this runs once a layer per decode step)
        attention_mask = left_padding_mask(inference_context, hidden_states, attention_mask)
        if (self.lean and not self.training and not torch.is_grad_enabled()
                and (inference_context is None or inference_context.is_static_batching())
                and key_value_states is None and rotary_pos_cos is None and rotary_pos_sin is None
                and rotary_pos_cos_sin is None and attention_bias is None and packed_seq_params is None
                and sequence_len_offset is None and inference_params is None):
            return lean_layer.attention_forward(self, hidden_states, attention_mask, inference_context,
                                                rotary_pos_emb)
        self._rotate_after_projection = (
            self.rotates_unfused and inference_context is None and inference_params is None
            and packed_seq_params is None and key_value_states is None and rotary_pos_emb is not None
            and lean_layer.rotates_whole_heads(self, rotary_pos_emb if isinstance(rotary_pos_emb, tuple)
                                                else (rotary_pos_emb,) * 2))
        try:  # SelfAttention's forward: the mask is made above
            return SelfAttention.forward(self, hidden_states, attention_mask, key_value_states, inference_context,
                                         rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                         attention_bias, packed_seq_params, sequence_len_offset,
                                         inference_params=inference_params)
        finally:
            self._rotate_after_projection = False

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs):
        if self._rotate_after_projection and inference_context is None and rotary_pos_emb is not None:
            # rotary_pos_emb is None here on a layer Megatron-Core's `no_rope_freq` exempts
            query, key, value, _, mask_type, block_table = SelfAttention._adjust_key_value_for_inference(
                self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
            cos, sin = rotation_tables(rotary_pos_emb[0], _yarn_get_concentration_factor_from_config(self.config),
                                       query.dtype)
            return rotate(query, cos, sin), rotate(key, cos, sin), value, None, mask_type, block_table
        return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                       *args, **kwargs)
