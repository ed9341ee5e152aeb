"""Weights, gradients and optimizer state per rank: what a training rank keeps between steps.

Every parameter tensor of a pipeline chunk is listed from the model's shape (`chunk_params`), in the shapes
Megatron-Core gives them at this layout (TP splits columns or rows, EP holds num_experts / EP experts, expert-TP splits
those, norms and the router are whole on every rank). From that list:

- weights = numel x bytes of the dtype. With the distributed optimizer DDP moves the parameters into one param buffer
  per chunk (dense, and expert parameters apart), padded as Megatron-Core pads it (`buffer_numel`);
- gradients = DDP's grad buffer, fp32 (the worker reduces gradients in fp32: `grad_reduce_in_fp32=True`, as NeMo's
  and Megatron-LM's bf16 recipes do; `Workload.grad_reduce_in_fp32=False` plans it in the weights' dtype), the same
  padded length. Overlapping the reduction (`overlap_grad_reduce`, `overlap_param_gather`) splits these buffers into
  buckets of the same total: it adds only each bucket's padding, which the plan leaves out (under 0.01% at
  Megatron-Core's 40M-element buckets);
- optimizer = Adam's exp_avg and exp_avg_sq (fp32, 8 bytes per parameter) + with bf16 weights an fp32 main copy (4
  bytes), + one fp32 step counter per parameter tensor (torch's Adam). The distributed optimizer keeps only this rank's
  1 / DP shard of each buffer (dense over DP x CP, experts over the expert-DP group), padding excluded.

With LoRA (`Workload.lora`) the base's parameters are frozen: they are weights alone, outside DDP's buffers, and only
the adapters (`adapter_params`) have a gradient buffer and optimizer state.

Megatron-LM's `theoretical_memory_usage.py` uses 18 bytes per parameter (6 + 12 / DP with the distributed
optimizer): bf16 weights 2 + fp32 grads 4 + fp32 main 4 + Adam 8. The same sum, without the padding and step counters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.plan.layouts import Layout, Workload

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = 4
"""fp32 gradient buffer (`grad_reduce_in_fp32=True` in `workers.training.build`)."""
ADAM_BYTES = 8
"""exp_avg + exp_avg_sq, fp32."""
MAIN_PARAM_BYTES = 4
"""fp32 main copy of a bf16 weight."""
STEP_COUNTER_BYTES = 4
PARAM_ALIGN = 64
"""Megatron-Core's DDP starts every parameter at a multiple of 64 elements with the distributed optimizer."""
BUCKET_ALIGN = 128


@dataclass(frozen=True)
class ChunkParams:
    """Parameter tensors (numel each) of one pipeline chunk on one rank."""

    dense: tuple[int, ...]
    expert: tuple[int, ...]
    shared_embedding: int = 0
    """The tied embedding's numel where it is held twice (PP > 1: first and last stage), its own DDP bucket."""


def is_moe_layer(model: ModelConfig, layer: int) -> bool:
    """Whether global layer `layer` (from 0) is an MoE layer (Megatron-Core's moe_layer_freq rule)."""
    if not model.is_moe:
        return False
    freq = model.moe_layer_freq
    return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0


def chunk_layers(model: ModelConfig, layout: Layout, pp_rank: int, chunk: int) -> range:
    """Global layer numbers (from 0) of chunk `chunk` of pipeline rank `pp_rank` (virtual stage chunk x PP + rank)."""
    chunks = layout.pp * (layout.vpp or 1)
    per = model.num_layers // chunks
    stage = chunk * layout.pp + pp_rank
    return range(stage * per, (stage + 1) * per)


def is_first(layout: Layout, pp_rank: int, chunk: int) -> bool:
    return chunk == 0 and pp_rank == 0


def is_last(layout: Layout, pp_rank: int, chunk: int) -> bool:
    return chunk == (layout.vpp or 1) - 1 and pp_rank == layout.pp - 1


def attention_params(m: ModelConfig, t: int) -> list[int]:
    """One layer's attention tensors on a TP rank: the fused QKV (and its bias), q/k norms and the output projection;
    or multi-latent attention's down projections (split over TP on the local spec), latent norms (whole on every rank),
    up projections and output projection."""
    h, bias = m.hidden_size, m.add_bias_linear
    if m.multi_latent_attention:
        heads = m.num_attention_heads // t
        q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
        out = [(m.kv_lora_rank + m.qk_pos_emb_head_dim) // t * h, m.kv_lora_rank,
               heads * (m.qk_head_dim + m.v_head_dim) * m.kv_lora_rank, heads * m.v_head_dim * h]
        if m.q_lora_rank is None:
            return out + [heads * q_head * h] + [h] * bias
        return out + [m.q_lora_rank // t * h, m.q_lora_rank, heads * q_head * m.q_lora_rank] + [h] * bias
    q, kv, d = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim, m.head_dim
    gates = q if m.attention_output_gate else 0  # projected with the queries
    return ([(q + gates + 2 * kv) // t * h] + [(q + 2 * kv) // t] * (bias or m.add_qkv_bias) + [d, d] * m.qk_layernorm
            + [q // t * h] + [h] * bias + [m.num_attention_heads // t] * m.attention_sinks)


def mamba_params(m: ModelConfig, t: int) -> list[int]:
    """One Mamba-2 layer's mixer tensors on a TP rank: the input projection (z, x, B, C and dt rows), the depthwise
    convolution and its bias over x, B and C, the per-head time-step bias, A and D, the gated norm and the output
    projection (Megatron-Core's `MambaMixer`, split by heads and groups)."""
    h, heads, inner, conv = m.hidden_size, m.mamba_num_heads // t, m.mamba_inner // t, m.mamba_conv_channels // t
    return [(inner + conv + heads) * h, conv * m.mamba_conv_kernel, conv, heads, heads, heads, inner, inner * h]


def delta_net_params(m: ModelConfig, t: int) -> list[int]:
    """One gated DeltaNet layer's tensors on a TP rank: the input projection (q, k, v, z, beta and alpha rows), the
    convolution over q, k and v, the per-value-head time-step bias and A, the output norm over a head (whole on every
    rank) and the output projection, split by heads."""
    h, heads = m.hidden_size, m.gdn_value_heads // t
    qk, v = m.gdn_key_dim // t, m.gdn_value_dim // t
    return [(2 * qk + 2 * v + 2 * heads) * h, (2 * qk + v) * m.gdn_conv_kernel, heads, heads, m.gdn_value_head_dim,
            v * h]


def _hybrid_layer_params(m: ModelConfig, t: int, kind: str, norm: list[int]) -> list[int]:
    """A hybrid model's Mamba-2, gated DeltaNet or attention layer (`ModelConfig.hybrid_pattern`): one norm and its
    mixer (its MLP and expert layers take the transformer's MLP path after their one norm)."""
    if kind == "M":
        return norm + mamba_params(m, t)
    if kind == "G":
        return norm + delta_net_params(m, t)
    return norm + attention_params(m, t)


def chunk_params(model: ModelConfig, layout: Layout, pp_rank: int, chunk: int) -> ChunkParams:
    """The parameter tensors this chunk holds (see the module)."""
    m, t = model, layout.tp
    h = m.hidden_size
    norm = [h, h] if m.normalization == "LayerNorm" else [h]
    bias = m.add_bias_linear
    gate = 2 if m.gated else 1
    dense: list[int] = []
    expert: list[int] = []
    vocab = m.padded_vocab_size(t) // t * h
    shared = 0
    if is_first(layout, pp_rank, chunk):
        dense.append(vocab)
        if m.position_embedding_type == "learned_absolute":
            dense.append(m.max_position_embeddings * h)
    for layer in chunk_layers(model, layout, pp_rank, chunk):
        kind = m.hybrid_pattern[layer] if m.is_hybrid else None
        if kind in ("M", "G", "*"):
            dense += _hybrid_layer_params(m, t, kind, norm)
            continue
        # a transformer layer, or a hybrid's MLP or experts after their one norm; Gemma's norms on the outputs too
        dense += norm if kind else norm + attention_params(m, t) + norm + norm * 2 * m.post_norms
        if is_moe_layer(model, layer):
            etp, fm = layout.etp or t, m.moe_ffn_hidden_size or m.ffn_hidden_size
            dense += [m.num_experts * h] + [m.num_experts] * bias  # router, whole on every rank
            for _ in range(m.num_experts // layout.ep):
                expert += [gate * fm // etp * h, fm // etp * h] + [gate * fm // etp, h] * bias
            if m.moe_shared_expert_intermediate_size:
                fs = m.moe_shared_expert_intermediate_size
                dense += [gate * fs // t * h, fs // t * h] + [h] * m.moe_shared_expert_gate
        else:
            f = m.ffn_hidden_size
            dense += [gate * f // t * h, f // t * h] + [gate * f // t, h] * bias
    if is_last(layout, pp_rank, chunk):
        dense += norm
        if not m.tie_word_embeddings:
            dense.append(vocab)
        elif layout.pp > 1:
            shared = vocab  # the output layer's copy of the embedding
    if m.tie_word_embeddings and layout.pp > 1 and is_first(layout, pp_rank, chunk):
        shared, dense = vocab, dense[1:]  # the embedding itself is the shared parameter
    return ChunkParams(dense=tuple(dense), expert=tuple(expert), shared_embedding=shared)


def adapter_params(model: ModelConfig, layout: Layout, lora: LoRAConfig, pp_rank: int, chunk: int) -> list[int]:
    """The LoRA adapters' tensors (numel each) of this chunk on one rank, as `core.modeling.lora.add_adapters` builds
    them: per target, A whole on every rank for a column-parallel layer (its parts' A stacked) and split over TP for a
    row-parallel one; each part's B split over TP for a column-parallel layer, whole for a row-parallel one. Dense
    MLPs only (an MoE layer's experts take no adapter); multi-latent attention has no fused QKV."""
    m, t, r = model, layout.tp, lora.rank
    h, f = m.hidden_size, m.ffn_hidden_size
    gated = m.gated
    heads = m.num_attention_heads
    out: list[int] = []
    for layer in chunk_layers(model, layout, pp_rank, chunk):
        if "linear_qkv" in lora.targets and not m.multi_latent_attention:
            kv = m.query_groups * m.head_dim
            out += [3 * r * h, heads * m.head_dim // t * r, kv // t * r, kv // t * r]
        if "linear_proj" in lora.targets:
            out += [r * heads * (m.v_head_dim if m.multi_latent_attention else m.head_dim) // t, h * r]
        if is_moe_layer(model, layer):
            continue
        if "linear_fc1" in lora.targets:
            out += [(1 + gated) * r * h] + [f // t * r] * (1 + gated)
        if "linear_fc2" in lora.targets:
            out += [r * f // t, h * r]
    return out


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def buffer_numel(sizes: tuple[int, ...], group: int, distributed: bool, shared: int = 0) -> int:
    """Elements of a DDP param/grad buffer holding tensors of `sizes` (reduced over `group` ranks).

    Megatron-Core 0.16 (`_ParamAndGradBuffer`): without the distributed optimizer the tensors end to end; with it,
    each starts at a multiple of 64 elements and each bucket ends at a multiple of lcm(group, 128), and a shared
    embedding is a bucket of its own. One bucket per buffer (the worker does not overlap the gradient reduction).
    """
    if not distributed:
        return sum(sizes) + shared
    bucket = math.lcm(group, BUCKET_ALIGN)
    main = _pad(sum(_pad(n, PARAM_ALIGN) for n in sizes), bucket) if sizes else 0
    return main + (_pad(_pad(shared, PARAM_ALIGN), bucket) if shared else 0)


def optimizer_share(layout: Layout, group: int) -> float:
    """The fraction of a buffer's optimizer state one rank keeps: 1 / (its reduction group) with the distributed
    optimizer (ZeRO-1), all of it without."""
    return 1 / group if layout.distributed_optimizer else 1.0


@dataclass(frozen=True)
class States:
    """Bytes one rank keeps between steps."""

    weights: int
    gradients: int
    optimizer: int
    params: int
    """Parameters (elements) this rank holds, without padding."""
    trainable: int
    """Of them, those with a gradient: all of them, or with LoRA the adapters'."""


_memo: ContextVar[dict[tuple, tuple[ModelConfig, States]] | None] = ContextVar("plan_states_memo", default=None)


@contextmanager
def memoized() -> Iterator[None]:
    """Within this block, `states` is computed once per layout that holds the same states (micro-batch, recompute and
    sequence parallelism change none of them): a search evaluates each such layout for every combination of those,
    and listing a large MoE's expert tensors is most of its time. A model is assumed unchanged inside the block."""
    token = _memo.set({} if _memo.get() is None else _memo.get())
    try:
        yield
    finally:
        _memo.reset(token)


def states(model: ModelConfig, layout: Layout, workload: Workload, world: int, pp_rank: int) -> States:
    """Weights, gradient buffers and optimizer state of a rank of pipeline stage `pp_rank` (module doc)."""
    memo = _memo.get()
    if memo is None:
        return _states(model, layout, workload, world, pp_rank)
    same = replace(layout, micro_batch_size=1, recompute=None, recompute_num_layers=1, sequence_parallel=False)
    key = (id(model), same, workload.dtype, repr(workload.lora), workload.grad_reduce_in_fp32, world, pp_rank)
    held = memo.get(key)
    if held is None or held[0] is not model:  # the model is kept with its entry: its id is not reused meanwhile
        held = memo[key] = (model, _states(model, same, workload, world, pp_rank))
    return held[1]


def _states(model: ModelConfig, layout: Layout, workload: Workload, world: int, pp_rank: int) -> States:
    e = DTYPE_BYTES[workload.dtype]
    dist = layout.distributed_optimizer
    per_param = ADAM_BYTES + (MAIN_PARAM_BYTES if workload.dtype != "fp32" else 0)
    weights = grads = optimizer = params = trainable = 0
    groups = {"dense": layout.dp(world) * layout.cp, "expert": layout.expert_dp(world)}
    for chunk in range(layout.vpp or 1):
        p = chunk_params(model, layout, pp_rank, chunk)
        if workload.lora is not None:  # the base is frozen weights; the adapters are what DDP and Adam hold
            frozen = sum(p.dense) + sum(p.expert) + p.shared_embedding
            weights, params = weights + frozen * e, params + frozen
            p = ChunkParams(dense=tuple(adapter_params(model, layout, workload.lora, pp_rank, chunk)), expert=())
        for kind, sizes, shared in (("dense", p.dense, p.shared_embedding), ("expert", p.expert, 0)):
            if not sizes and not shared:
                continue
            group = groups[kind]
            numel = buffer_numel(sizes, group, dist, shared)
            unpadded, tensors = sum(sizes) + shared, len(sizes) + bool(shared)
            params, trainable = params + unpadded, trainable + unpadded
            weights += (numel if dist else unpadded) * e
            grads += numel * (GRAD_BYTES if workload.grad_reduce_in_fp32 else e)
            share = optimizer_share(layout, group)
            optimizer += round((unpadded * per_param + tensors * STEP_COUNTER_BYTES) * share)
    return States(weights=weights, gradients=grads, optimizer=optimizer, params=params, trainable=trainable)
