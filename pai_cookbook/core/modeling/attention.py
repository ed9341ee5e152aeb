"""The local path's attention swaps, on a GPU without Transformer Engine and on a CPU (`core.machine.build.LOCAL_SWAPS`):
`SDPAttention` (the core attention on PyTorch's fused kernel) and `LeftPaddedSelfAttention` (a static KV cache of
rotated keys, for batches of prompts of different lengths, left-padded).

Megatron-Core's local spec (no Transformer Engine: every CPU run) computes attention unfused: the scores
[b, heads, sq, sk] materialised by `baddbmm`, masked, a softmax, then `bmm` with the values, with grouped
keys and values first repeated to every query head. `SDPAttention` is that module with its forward on
PyTorch's fused kernel (on CPU a flash-attention kernel that never holds the score matrix; on CUDA without
Transformer Engine, flash or memory-efficient kernels): same parameters (none), same inputs and outputs.

- Causal: Megatron-Core's rule (a causal mask when none is given and the query has more than one position,
  queries and keys aligned from position 0); a one-position query (a KV-cached decode step) sees every key.
- Grouped-query attention: the kernel's `enable_gqa`, so keys and values are not repeated (the sinks' path, below,
  repeats them).
- A given boolean mask (True: masked, Megatron-Core's convention; e.g. `sft.attention_mask`, block-diagonal for
  packed rows) is passed to the kernel, inverted.
- Sliding windows (`TransformerConfig.window_size`, on the layers Megatron-Core gives one): the window's mask
  joined to the mask given or to the causal one (upstream's unfused softmax puts the window's mask in place of a
  given one, so padded and packed rows would see across their boundaries).
- Attention sinks (`TransformerConfig.softmax_type="learnable"`, GPT-OSS): each head's learned logit joins every row
  of scores as one more column, and its probability is dropped after the softmax, as transformers computes it; the
  scores are materialised (the fused kernel takes no such column), masked as above (upstream's unfused softmax
  takes the sinks but, on a sliding-window layer, its window's mask in place of the padding's).
- What it does not cover falls back to Megatron-Core's own forward, unchanged: attention dropout while
  training (its mask is drawn from Megatron-Core's RNG tracker), the other softmax with an offset ("off-by-one"),
  attention bias.

`core.modeling.layer_spec.layer_spec` swaps it in wherever the local spec's `DotProductAttention` is used, unless the model
asks for the unfused one (`ModelConfig.attention_backend="unfused"`, as the parity tests do).

Every tensor made here takes the device of the tensors it meets (the padding's, the queries'): the same code runs
on the GPU path (`core.machine.device_guard` checks that on the CPU in CI).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class SplitWidthAttention(DotProductAttention):
    """Megatron-Core's local `DotProductAttention` taking the head widths multi-latent attention builds its core attention
    with (`k_channels`: query/key heads, no-rotary part + rotary part; `v_channels`: value heads), as Transformer
    Engine's does; upstream's local one takes neither and shapes its output as heads x kv_channels. Its scores and
    softmax are upstream's (the softmax scale is given); its output is heads x v_channels wide."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        state = torch.random.get_rng_state()
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        if isinstance(self.softmax_offset, torch.nn.Parameter) and self.config.perform_initialization:
            torch.random.set_rng_state(state)
            self._draw_sinks_whole()

    def _draw_sinks_whole(self) -> None:
        """The attention sinks drawn for every head and this rank's heads kept, as Megatron-Core draws a linear's
        weight whole on the CPU: upstream draws each rank's heads alone, from the same stream, so TP=2's ranks got the
        same sinks and a seed gave a different model at every TP."""
        from megatron.core import parallel_state

        part = self.softmax_offset.numel()
        whole = self.config.init_method(torch.empty(part * parallel_state.get_tensor_model_parallel_world_size(),
                                                    dtype=self.softmax_offset.dtype))
        rank = parallel_state.get_tensor_model_parallel_rank()
        with torch.no_grad():
            self.softmax_offset.copy_(whole[rank * part:(rank + 1) * part])


class SDPAttention(SplitWidthAttention):
    """Megatron-Core's `DotProductAttention` computed by `scaled_dot_product_attention` (see the module)."""

    def _fused(self) -> bool:
        dropout = self.training and self.attention_dropout.p > 0
        layer_scaling = self.scale_mask_softmax.scale is not None  # apply_query_key_layer_scaling
        return not dropout and not layer_scaling and (self.softmax_offset is None or self.config.softmax_type == "learnable")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused() or attention_bias is not None or packed_seq_params is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        sq, b, heads, _ = query.shape
        sk = key.shape[0]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask, causal = None, False
        window = self.scale_mask_softmax.window_size  # Megatron-Core's choice for this layer (window_attn_skip_freq)
        sinks = self.softmax_offset
        if attention_mask is not None:
            mask = ~attention_mask  # the kernel's convention: True attends
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"causal attention without a mask needs as many queries as keys ({sq} vs {sk})")
            causal = window is None and sinks is None
            if sinks is not None:
                mask = ~outside_window(sq, sk, (sk, 0), q.device)  # causal
        if window is not None:  # with the mask given (padding, packed rows), not in its place as upstream's softmax
            outside = outside_window(sq, sk, window, q.device)
            mask = ~outside if mask is None else mask & ~outside
        if sinks is not None:
            out = sink_attention(q, k, v, mask, self.softmax_scale, sinks)
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])
        # Multi-latent attention's values are narrower than its queries and keys, and the fused kernels take one width
        # (PyTorch's CPU kernel falls back to materialised scores, in fp32, otherwise): the values are padded with
        # zeros, which add zero columns to the output, cut off after (as Megatron-Core pads them for its MLA kernels).
        pad = q.shape[-1] - v.shape[-1]
        if pad > 0:
            v = torch.nn.functional.pad(v, (0, pad))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != heads)
        if pad > 0:
            out = out[..., :-pad]
        # [b, n, sq, d_v] -> [sq, b, n * d_v]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learned sink logit per head ([b, n, s, d] queries, keys and values with n or fewer heads;
    `mask` True attends): the scores `q k^T * scale`, masked, with each head's sink as one more column, softmax (in
    fp32, as Megatron-Core's attention_softmax_in_fp32), the sink's column dropped, times the values. A row masked
    whole gives the sink all its probability and the output zeros (no NaN)."""
    b, heads, sq, _ = q.shape
    if k.shape[1] != heads:  # grouped-query attention: each key/value head serves heads / groups query heads
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, -1, sq, 1)
    probabilities = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]
    return torch.matmul(probabilities.to(v.dtype), v)


def outside_window(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor:
    """[sq, sk] True where a key lies outside a query's sliding window: the queries are the last `sq` of `sk`
    positions, and query i sees keys i - window[0] .. i + window[1] (Transformer Engine's `window_size`;
    Megatron-Core's `get_sliding_window_causal_mask`). Hugging Face's `sliding_window` W is (W - 1, 0)."""
    queries = torch.arange(sk - sq, sk, device=device)[:, None]
    keys = torch.arange(sk, device=device)[None, :]
    return (keys < queries - window[0]) | (keys > queries + window[1])


class _SumRotaryKeyGradient(torch.autograd.Function):
    """Identity forward; backward sums, over the tensor-parallel group, the gradient of the last columns from
    `first` on (the rotary key, which every rank's heads use, so each rank's gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, kv_combined: torch.Tensor, first: int, group) -> torch.Tensor:
        ctx.first, ctx.group = first, group
        return kv_combined

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        rotary = grad[..., ctx.first:].contiguous()
        torch.distributed.all_reduce(rotary, group=ctx.group)
        grad[..., ctx.first:] = rotary
        return grad, None, None


class LatentSelfAttention(MLASelfAttention):
    """Megatron-Core's multi-latent attention with the rotary key's gradient summed over tensor parallelism, on the local
    spec (the `latent_attention` swap); the forward is upstream's, value for value.

    The local spec splits the key/value down projection's output over TP ranks ([latent | rotary key] / TP), gathers it
    and hands the rotary key to every rank's heads. Each rank's heads give the rotary key a partial gradient, and the
    gather's backward keeps each rank's own columns of its own partial sum: the rotary key's rows of the down projection
    learn from one rank's heads (measured: TP=2 training drifts 1e-5 from one process in 5 steps, where every other
    layout of the same model stays within 2.4e-7). Transformer Engine's spec (a duplicated down projection, its
    gradient averaged over TP) has no such split. Here the gathered output is handed on as that spec's would be: whole,
    or under sequence parallelism this rank's slice of the sequence (upstream then gathers the rotary key over the
    sequence, whose backward sums it over TP); without sequence parallelism the rotary columns' gradient is summed."""

    def _qkv_down_projection(self, hidden_states):
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        if kv_combined.size(-1) == self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim:
            return q_compressed, kv_combined  # not split over TP
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if self.config.sequence_parallel:
            return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        return q_compressed, _SumRotaryKeyGradient.apply(kv_combined, self.config.kv_lora_rank, self.tp_group)


LEFT_PADDING = "cookbook_left_padding"
"""Attribute of a static inference context: a [batch] tensor of each row's left-padding tokens, set by the
generation worker for a batch of prompts of different lengths (`workers.generate.generate_batch`), or None."""


def left_padded_positions(padding: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[length, rows] positions of tokens start..start+length-1 of left-padded rows: each row counts from 0 at its
    first real token, as an unpadded row would (its padding is given position 0; it is masked anyway)."""
    steps = torch.arange(start, start + length, device=padding.device)
    return (steps[:, None] - padding[None, :]).clamp(min=0)


def left_padded_mask(padding: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[rows, 1, length, start+length] attention mask (True: masked, Megatron-Core's convention) for queries
    start..start+length-1 of left-padded rows: causal, and no real token sees its row's padding. A padding
    position sees itself, so no row of scores is masked whole (a softmax over nothing is NaN, and a NaN value
    times a zero weight would still reach the real tokens)."""
    queries = torch.arange(start, start + length, device=padding.device)[:, None]
    keys = torch.arange(start + length, device=padding.device)[None, :]
    masked = (keys > queries) | ((keys < padding[:, None, None]) & (keys != queries))
    return masked[:, None]


def _per_step(context, kind: str, rows: int, length: int, build):
    """What every layer of one forward step computes alike (mask, positions), built once per step and micro-batch.

    The cache belongs to the batch's padding tensor: a new batch (a new `LEFT_PADDING`) starts it afresh, so two
    batches whose steps share offsets and lengths never share a mask."""
    padding = getattr(context, LEFT_PADDING, None)
    cached = context.__dict__.get("_cookbook_step_cache")
    if cached is None or cached[0] is not padding:  # holding the tensor keeps its identity from being reused
        cached = context.__dict__["_cookbook_step_cache"] = (padding, {})
    cache = cached[1]
    key = (kind, context.batch_size_offset, rows, context.sequence_len_offset, length)
    if key not in cache:
        if len(cache) > 8:  # entries of earlier steps are never asked for again
            cache.clear()
        cache[key] = build()
    return cache[key]


def _left_padded(context) -> bool:
    """Whether `context` is a static inference context running a left-padded batch."""
    return context is not None and context.is_static_batching() and getattr(context, LEFT_PADDING, None) is not None


def padding_of(context, rows: int) -> torch.Tensor | None:
    """The left padding of the `rows` rows a static inference context is running now, or None (no padding, no
    static context)."""
    if not _left_padded(context):
        return None
    return getattr(context, LEFT_PADDING)[context.batch_size_offset:context.batch_size_offset + rows]


def _step_freqs(pos_emb: torch.Tensor, padding: torch.Tensor | None, start: int, length: int) -> torch.Tensor:
    """Rows start..start+length-1 of a [positions, 1, 1, d] rotary table ([s, 1, 1, d]), or for left-padded rows
    each row's own positions (`left_padded_positions`: [s, b, 1, d])."""
    if padding is None:
        return pos_emb[start:start + length]
    return pos_emb[left_padded_positions(padding, start, length)].squeeze(2)


def step_rotation(context, pos_emb: torch.Tensor, rows: int, length: int, mscale: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary frequencies at this step's positions in a static inference context, as Megatron-Core's
    `_apply_rotary_pos_emb_bshd` makes them (`(cos(freqs) * mscale).to(dtype)`), built once a step for every layer
    (Megatron-Core makes them again for the queries and for the keys of each layer). Left-padded rows count their
    positions from their first real token (`left_padded_positions`). Shapes broadcast against [s, b, heads, d]."""
    def build():  # once a step: the cache's key holds the offsets and the batch's padding
        return rotation_tables(_step_freqs(pos_emb, padding_of(context, rows), context.sequence_len_offset, length),
                               mscale, dtype)

    # the table in the key: layers of two kinds (Gemma 3's sliding and full layers) rotate with two tables
    return _per_step(context, ("rotation", dtype, id(pos_emb)), rows, length, build)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`t * cos + rotate_half(t) * sin`: Megatron-Core's `_apply_rotary_pos_emb_bshd` over whole heads, not interleaved,
    on tables made as it makes them (`step_rotation`, `rotation_tables`), without its last `torch.cat` of the rotated
    part with an empty pass-through part, which copies the same values (and whose backward adds a tensor of zeros
    to the gradient)."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    return t * cos + _rotate_half(t, False) * sin


def rotation_tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary frequencies as `_apply_rotary_pos_emb_bshd` makes them: `(cos(freqs) * mscale).to(dtype)`."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


class LeftPaddedSelfAttention(SelfAttention):
    """Megatron-Core's `SelfAttention` whose static-batching KV cache holds keys already rotated, so that a batch of
    prompts of different lengths can be left-padded (the local path's `left_padded_kv_cache` swap, on a GPU and a CPU).

    Megatron-Core's static inference path stores each new key before its rotary embedding and, at every
    decode step, rotates the whole cached prefix again (`k_pos_emb[:sequence_end]` over every cached key, in
    every layer), with one table for every row: work and memory traffic that grow with the sequence, and no way
    for rows to sit at different positions. Its dynamic path, like Hugging Face's cache, rotates a key once,
    at its own position, before storing it. This class does that for static batching: the new keys are
    rotated with their positions' frequencies, stored, and the key embedding handed back is None, so
    `Attention.forward` rotates only the queries. Rotation is elementwise per position, so every key holds
    the values the old path recomputed, bit for bit. Anything else (training, the dynamic context, flash
    decoding, multi-latent attention, packed sequences) is `SelfAttention`'s, unchanged.

    Left-padded batches (the context's `LEFT_PADDING`, on the model's device): each row's queries and keys are
    rotated at the row's own positions (`left_padded_positions`: from 0 at its first real token, as without padding)
    and its padding is masked (`left_padded_mask`), so a row computes what it would alone. The mask reaches the core
    attention as Megatron-Core's local `DotProductAttention` and `SDPAttention` take it; Transformer Engine's spec
    keeps upstream's `SelfAttention` (`core.modeling.layer_spec`), and its generation right-pads as Megatron-Core does.
    """

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        return super().forward(hidden_states, left_padding_mask(inference_context, hidden_states, attention_mask),
                               key_value_states, inference_context, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                               rotary_pos_cos_sin, attention_bias, packed_seq_params, sequence_len_offset,
                               inference_params=inference_params)

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs):
        if (inference_context is None or not inference_context.is_static_batching() or rotary_pos_emb is None
                or self.config.flash_decode or self.config.multi_latent_attention):
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           *args, **kwargs)
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
        from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

        q_pos_emb, k_pos_emb = rotary_pos_emb
        start, length = inference_context.sequence_len_offset, key.size(0)
        padding = padding_of(inference_context, key.size(1))  # key: [s, b, groups, d]
        if padding is None:
            k_rows = _step_freqs(k_pos_emb, None, start, length)
        else:
            k_rows, q_rows = _per_step(inference_context, ("rotary", id(k_pos_emb)), key.size(1), length, lambda: (
                _step_freqs(k_pos_emb, padding, start, length), _step_freqs(q_pos_emb, padding, start, length)))
        key = apply_rotary_pos_emb(key, k_rows, config=self.config,
                                   mscale=_yarn_get_concentration_factor_from_config(self.config),
                                   cp_group=self.pg_collection.cp)
        query, key, value, (q_pos_emb, _), mask_type, block_table = super()._adjust_key_value_for_inference(
            inference_context, query, key, value, (q_pos_emb, k_pos_emb), *args, **kwargs)
        return query, key, value, (q_pos_emb if padding is None else q_rows, None), mask_type, block_table


def left_padding_mask(inference_context, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
                      ) -> torch.Tensor | None:
    """The attention mask of this step of a left-padded static batch (built once a step for every layer), or
    `attention_mask` as given where the batch is not left-padded. `hidden_states`: [s, b, h]."""
    if not _left_padded(inference_context):
        return attention_mask
    rows, length = hidden_states.size(1), hidden_states.size(0)
    return _per_step(inference_context, "mask", rows, length, lambda: left_padded_mask(
        padding_of(inference_context, rows), inference_context.sequence_len_offset, length))
