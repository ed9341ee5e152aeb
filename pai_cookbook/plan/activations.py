"""Activations: the bytes autograd keeps for backward, per layer and micro-batch, and their peak over the pipeline
schedule on one rank, on the layer path the run builds (`Workload.path`).

**Transformer Engine's spec** (the default on a GPU; each tensor is what upstream's code saves, docs/planning.md cites
each): a norm fused into the linear after it (TE's `LayerNormLinear`) keeps its input and its output in e and 1/rms in
fp32 (LayerNorm: its mean too), s_n b (2 h e + 4), whether or not its output is gathered for the linear (TE saves the
local slice and gathers again in backward); attention keeps what the local spec's does (the QKV output, alive as v's
storage, rotated q and k, the fused kernel's output and log-sum-exp), with the rotary embedding fused (no cos and sin
per layer); a dense SwiGLU MLP keeps fc1's output and the fused activation's, 3 s b f/t e (GELU: 2 s b f/t e); an MoE
layer's experts keep fc1's output and the probability-weighted activation's, 3 N f_moe/etp e; the final norm is TE's
(input, output, 1/rms). With MHA, GELU, no rotary embedding and no dropout this is Korthikanti et al. 2022's per-layer
count without the attention scores and the dropout masks, 32 s b h bytes (tests/test_plan.py).

**The local spec** (a GPU without TE, LoRA, and the cookbook's CPU check): what Megatron-Core's local spec saves
with PyTorch's kernels (the cookbook's `PAI_COOKBOOK_LAYERS=local` path: `core.modeling.attention.SDPAttention` on
`scaled_dot_product_attention`'s flash kernel, `torch.nn.RMSNorm`), read off the operators and checked against
`core.measures.memory_probe` on a CPU (docs/planning.md lists every tensor). On a GPU torch runs RMSNorm as one kernel,
which keeps what Transformer Engine's norm keeps; the norms below are its CPU decomposition (`Workload.device`).
Per micro-batch of b sequences of s tokens (s = seq / CP), e bytes per activation (2 in bf16, 4 in fp32),
t = TP, s_n = s / t where sequence parallelism splits the norms' regions (else s), h hidden, q = heads x head_dim,
kv = groups x head_dim, f = ffn:

- each norm: its input upcast to fp32 and the normalised x in fp32 (2 s_n b h x 4) + 1/rms (s_n b x 4), and its
  output in e (what the next matmul saves);
- attention: the QKV output s b (q + 2kv)/t e (the values are a view of it), rotated q and k (s b (q + kv)/t e), the
  kernel's output s b q/t e and log-sum-exp b (heads/t) s x 4; the rotary cos and sin of q and k (4 s head_dim e);
- dense SwiGLU MLP: fc1's output 2f, silu's output, the up half + offset, their product: 5 s b f/t e;
- MoE layer (T = s_n b tokens routed here, E experts, k = top-k, N tokens reaching this rank's experts: T k when
  dropless (balanced), E x capacity when padded to capacity): router scores T E x 4, top-k indices T k x 8 and
  probabilities T k x 4, routing map T E, tokens per expert E x 8 (a sigmoid router: the top-k scores' sum T x 4;
  group-limited routing: each group's best k/G_k indices T G (k/G_k) x 8, the chosen groups T G_k x 8 and the expert
  mask T E); the dispatcher's sort indices and probabilities; the permuted tokens N h e (with expert-TP, N counts the
  expert-TP group's tokens: the dispatcher gathers them); each expert's SwiGLU plus the probability scaling:
  6 N f_moe/etp e;
- first stage: the token ids (s b x 8, and the vocabulary mask s b at TP > 1); last stage: the final norm, the output
  layer's input, the loss's exp(logits) in fp32 s b V/t x 4 and its targets (s b x 13) and the loss mask (s b x 4).

**The CPU path** (`local+cpu`, a CPU run's default): the local spec with `pai_cookbook.cpu`'s converters, two of
which change what training saves: a dense SwiGLU MLP as one autograd function (`cpu.glu`: fc1's output, silu's, and
the product fc2 keeps, 4 s b f/t e; a shared expert and the experts are Megatron-Core's), and queries and keys rotated
with one cos/sin pair where the rotation covers whole heads (`cpu.attention`: 2 s head_dim e).

LoRA (`Workload.lora`, the base frozen: `lora_bytes`): a decomposed norm (a CPU) with a frozen weight keeps its fp32
input and 1/rms but not the normalised input (only its weight's gradient needed it), a fused one what it kept; the
first layer's first norm, whose input (the
frozen embedding's output) needs no gradient, keeps nothing (under full recompute the embedding's output is made to
need one, so that the recomputed layers' adapters get theirs); Megatron-Core's frozen linears keep no input
(`linear_with_frozen_weight`): the adapters' A keeps it instead, so a linear without an adapter drops it (the norm
outputs before QKV and FC1, the product before FC2; the kernel keeps its output for attention's projection), and the
frozen output layer drops its input. Each adapter keeps A's output for B: s b (parts x r) e where a column-parallel
layer gathers it, s_n b r e after a row-parallel layer's reduction.

Recompute: selective (core_attn) drops the kernel's log-sum-exp (with a flash kernel nothing else: q, k, v and the
output are saved anyway), full keeps each checkpoint's input (s_n b h e) and the rotary frequencies (s head_dim x 4,
one tensor per rank: Megatron-Core caches it), and recomputes one group of layers in backward, whose activations then
exist at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.core.machine.build import CPU_LAYERS, TE_LAYERS
from pai_cookbook.plan.layouts import Layout, Workload
from pai_cookbook.plan.states import DTYPE_BYTES, chunk_layers, is_first, is_last, is_moe_layer

FP32, INT64, BOOL = 4, 8, 1


@dataclass(frozen=True)
class Dims:
    """A micro-batch's sizes on one rank, and the layer path."""

    s: int
    """Sequence on this rank (seq / CP)."""
    s_norm: int
    """Sequence in the norm regions (s / TP with sequence parallelism)."""
    b: int
    e: int
    te: bool = False
    """Transformer Engine's spec (else the local spec)."""
    cpu: bool = False
    """The CPU path (`local+cpu`): the local spec with `pai_cookbook.cpu`'s converters (module doc)."""
    fused_norm: bool = True
    """The norms keep their input in e, not fp32 copies: Transformer Engine's, and torch's RMSNorm on CUDA (module
    doc); False: the local spec's RMSNorm on a CPU."""
    moe_imbalance: float = 1.0


def dims(layout: Layout, workload: Workload) -> Dims:
    s = workload.seq_length // layout.cp
    return Dims(s=s, s_norm=s // layout.tp if layout.sequence_parallel else s, b=layout.micro_batch_size,
                e=DTYPE_BYTES[workload.dtype], te=workload.path == TE_LAYERS, cpu=workload.path == CPU_LAYERS,
                fused_norm=workload.device == "cuda", moe_imbalance=workload.moe_imbalance)


def decomposed_norm(model: ModelConfig, x: Dims) -> bool:
    """torch's RMSNorm on a CPU (`rms_norm_composite`), where the norm keeps fp32 copies; every other norm is one
    kernel (Transformer Engine's; torch's `_fused_rms_norm` on CUDA; `native_layer_norm`)."""
    return not x.fused_norm and model.normalization != "LayerNorm"


def norm_input_bytes(model: ModelConfig, x: Dims, width: int | None = None) -> int:
    """What one norm over `width` (the hidden size by default) keeps for its input's gradient: the input (in fp32 when
    decomposed, else in e) and the per-token statistics (1/rms, or LayerNorm's mean and 1/std)."""
    tokens, layer_norm = x.s_norm * x.b, model.normalization == "LayerNorm"
    return tokens * (width or model.hidden_size) * (FP32 if decomposed_norm(model, x) else x.e) + \
        tokens * FP32 * (1 + layer_norm)


def norm_bytes(model: ModelConfig, x: Dims, width: int | None = None) -> int:
    """One norm: `norm_input_bytes`, the normalised input in fp32 when decomposed (for its weight's gradient), and its
    output in e (what the next matmul keeps)."""
    width = width or model.hidden_size
    normalised = x.s_norm * x.b * width * FP32 if decomposed_norm(model, x) else 0
    return norm_input_bytes(model, x, width) + normalised + x.s_norm * x.b * width * x.e


def latent_attention_bytes(model: ModelConfig, layout: Layout, x: Dims) -> int:
    """Multi-latent attention (n = heads / t, d_q = query/key head, d_v = value head, r = the rotary part): the query
    and key/value latents' norms (on the sequence-parallel slice); the concatenated queries and keys, the values padded
    to d_q for the fused kernel, and its output, s b n d_q e each; the output cut to d_v and made contiguous for the
    output projection (s b n d_v e); the log-sum-exp; the rotary cos and sin (4 s r e)."""
    m, t = model, layout.tp
    heads, q_head = m.num_attention_heads // t, m.qk_head_dim + m.qk_pos_emb_head_dim
    saved = norm_bytes(m, x, m.kv_lora_rank) + (norm_bytes(m, x, m.q_lora_rank) if m.q_lora_rank else 0)
    saved += x.s * x.b * heads * (4 * q_head + m.v_head_dim) * x.e
    if layout.recompute != "selective":
        saved += x.b * heads * x.s * FP32  # log-sum-exp
    return saved + 4 * x.s * m.qk_pos_emb_head_dim * x.e


def attention_bytes(model: ModelConfig, layout: Layout, x: Dims) -> int:
    m, t = model, layout.tp
    if m.multi_latent_attention:
        return latent_attention_bytes(model, layout, x)
    q, kv, d = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim, m.head_dim
    tokens = x.s * x.b
    saved = tokens * (q + 2 * kv + q + kv + q + 2 * q * m.attention_output_gate) // t * x.e  # a gate and its product
    if layout.recompute != "selective":
        saved += x.b * (m.num_attention_heads // t) * x.s * FP32  # log-sum-exp
    if m.position_embedding_type == "rope" and not x.te:
        # cos and sin for q and for k (TE's fused rotary kernel keeps neither); the CPU path rotates both with one pair
        whole_heads = m.rotary_percent == 1.0
        saved += (2 if x.cpu and whole_heads else 4) * x.s * d * x.e
    return saved


def mlp_bytes(model: ModelConfig, layout: Layout, x: Dims, ffn: int, dense: bool = True) -> int:
    """A dense MLP (`dense`), or an MoE layer's shared expert. SwiGLU: the local spec keeps fc1's output, silu's, the
    up half (+0) and the product, 5f per token; Transformer Engine's fused activation keeps its input (fc1's output)
    and fc2 its input, 3f; the CPU path's dense MLP (`cpu.glu`) fc1's output, silu's and the product, 4f. GELU: 2f."""
    swiglu = 3 if x.te else 4 if x.cpu and dense else 5
    per_token = swiglu * ffn if model.gated else 2 * ffn
    return x.s * x.b * per_token // layout.tp * x.e


def expert_tokens(model: ModelConfig, layout: Layout, tokens: int) -> int:
    """Tokens reaching this rank's experts per MoE layer: T k dropless (balanced routing), E x capacity padded."""
    k, experts = model.moe_router_topk, model.num_experts
    if model.moe_expert_capacity_factor is not None and model.moe_pad_expert_input_to_capacity:
        capacity = -(-int(tokens * k * model.moe_expert_capacity_factor) // experts)
        return experts * capacity
    return tokens * k


def moe_bytes(model: ModelConfig, layout: Layout, x: Dims) -> int:
    m = model
    tokens = x.s_norm * x.b if layout.tp > 1 else x.s * x.b  # each TP rank routes its own slice (SP)
    experts, k = m.num_experts, m.moe_router_topk
    sent = tokens * k if m.moe_expert_capacity_factor is None else expert_tokens(m, layout, tokens)
    # with expert-TP each rank's expert shards take the tokens of its whole expert-TP group (the dispatcher gathers them)
    received = expert_tokens(m, layout, tokens) * (layout.etp or layout.tp)
    if layout.ep > 1:  # the most loaded expert-parallel rank (Workload.moe_imbalance; 1.0: balanced)
        received = round(received * x.moe_imbalance)
    router = tokens * experts * FP32 + tokens * k * (INT64 + FP32) + tokens * experts * BOOL + experts * INT64
    router += FP32 * (m.moe_aux_loss_coeff > 0)
    if m.moe_router_score_function == "sigmoid" and k > 1:
        router += tokens * FP32  # the chosen scores' sum, which normalises them
    if m.moe_router_num_groups:  # group-limited routing: each group's best scores, the chosen groups, the expert mask
        groups, picked = m.moe_router_num_groups, m.moe_router_group_topk
        router += tokens * (groups * (k // picked) + picked) * INT64 + tokens * experts * BOOL
    if m.moe_expert_capacity_factor is None:
        dispatch = sent * INT64 + tokens * experts * FP32
    else:
        dispatch = 2 * sent * INT64
    probs = received * (FP32 if x.e == FP32 else x.e)
    fm = m.moe_ffn_hidden_size or m.ffn_hidden_size
    per_expert_token = 3 if x.te else 6  # TE: fc1's output and the fused weighted SwiGLU's; local: SwiGLU + scaling
    experts_saved = received * m.hidden_size * x.e + received * per_expert_token * fm // (layout.etp or layout.tp) * x.e
    shared = 0
    if m.moe_shared_expert_intermediate_size:
        shared = mlp_bytes(m, layout, x, m.moe_shared_expert_intermediate_size, dense=False)
    return router + dispatch + probs + experts_saved + shared


def mamba_bytes(model: ModelConfig, layout: Layout, x: Dims) -> int:
    """A Mamba-2 mixer: what the fused scan (`mamba_split_conv1d_scan_combined`) keeps for its backward, the input
    projection's output (z, x, B, C, dt per token) and the state entering each chunk (fp32), then the gated norm's input
    and gate product and the output projection's input (d_inner each per token), split over TP by heads."""
    m, t = model, layout.tp
    heads, inner = m.mamba_num_heads, m.mamba_inner
    projected = inner + m.mamba_conv_channels + heads
    chunks = -(-x.s // m.mamba_chunk_size)
    states = x.b * chunks * heads * m.mamba_head_dim * m.mamba_state_dim * FP32
    return (x.s * x.b * (projected + 3 * inner) * x.e + states) // t


def delta_net_bytes(model: ModelConfig, layout: Layout, x: Dims) -> int:
    """A gated DeltaNet: the input projection's output (q, k, v, z, beta, alpha per token), the convolution's output
    and the normalised q and k, the delta rule's output and the state entering each chunk of 64 (fp32), the gated
    norm's input, gate product and the output projection's input; split over TP by heads. Modelled from what the
    layer computes, not yet checked against a measured run."""
    m = model
    heads, qk, v = m.gdn_value_heads, m.gdn_key_dim, m.gdn_value_dim
    per_token = (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) + 2 * qk + 4 * v
    states = x.b * -(-x.s // 64) * heads * m.gdn_key_head_dim * m.gdn_value_head_dim * FP32
    return (x.s * x.b * per_token * x.e + states) // layout.tp


def layer_bytes(model: ModelConfig, layout: Layout, x: Dims, layer: int) -> int:
    """Everything one layer saves for one micro-batch without full recompute."""
    if model.is_hybrid:  # one norm and one mixer
        mixers = {"M": mamba_bytes, "G": delta_net_bytes, "*": attention_bytes, "E": moe_bytes,
                  "-": lambda m, lay, d: mlp_bytes(m, lay, d, m.ffn_hidden_size)}
        return norm_bytes(model, x) + mixers[model.hybrid_pattern[layer]](model, layout, x)
    saved = 2 * norm_bytes(model, x) + attention_bytes(model, layout, x)
    if is_moe_layer(model, layer):
        return saved + moe_bytes(model, layout, x)
    return saved + mlp_bytes(model, layout, x, model.ffn_hidden_size)


def lora_bytes(model: ModelConfig, layout: Layout, x: Dims, lora: LoRAConfig, layer: int, first: bool) -> int:
    """What one layer saves with LoRA beyond (or, negative, short of) `layer_bytes` (module doc); `first`: the first
    layer of the model, whose input needs no gradient."""
    tokens, norm_tokens, h = x.s * x.b, x.s_norm * x.b, model.hidden_size
    normalised = norm_tokens * h * FP32 if decomposed_norm(model, x) else 0  # only the frozen weight's gradient used it
    targets = set(lora.targets) - ({"linear_qkv"} if model.multi_latent_attention else set())
    dense = not is_moe_layer(model, layer)
    if not dense:
        targets -= {"linear_fc1", "linear_fc2"}
    delta = -2 * normalised
    if first:  # the first norm keeps nothing but its output (what QKV's adapter keeps)
        delta -= norm_input_bytes(model, x)
    parts = {"linear_qkv": 3, "linear_fc1": 2 if model.gated else 1}
    for target in targets:
        if target in parts:
            delta += tokens * parts[target] * lora.rank * x.e
        else:
            delta += norm_tokens * lora.rank * x.e
    if "linear_qkv" not in targets and not model.multi_latent_attention:
        delta -= norm_tokens * h * x.e
    if dense and "linear_fc1" not in targets:
        delta -= norm_tokens * h * x.e
    if dense and "linear_fc2" not in targets:
        delta -= tokens * model.ffn_hidden_size // layout.tp * x.e
    return delta


def embedding_bytes(layout: Layout, x: Dims) -> int:
    tokens = x.s * x.b
    return tokens * INT64 + (tokens * BOOL if layout.tp > 1 else 0)


def head_bytes(model: ModelConfig, layout: Layout, x: Dims, frozen: bool = False) -> int:
    """The last stage's final norm, output-layer input, and the loss over the vocabulary (fp32 exp(logits)); `frozen`
    (LoRA): what the norm keeps for its input alone (module doc)."""
    tokens = x.s * x.b
    vocab = model.padded_vocab_size(layout.tp) // layout.tp
    loss = tokens * vocab * FP32 + tokens * (INT64 + BOOL) + tokens * FP32 + FP32
    norm = norm_input_bytes(model, x) if frozen else norm_bytes(model, x)
    return norm + loss


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk's micro-batch: what its forward leaves saved, the part its backward frees first (the loss
    and output layer), and what a backward adds on top while it recomputes (full recompute)."""

    forward: int
    head: int
    recompute: int


def chunk_bytes(model: ModelConfig, layout: Layout, workload: Workload, pp_rank: int, chunk: int) -> Chunk:
    x = dims(layout, workload)
    layers = list(chunk_layers(model, layout, pp_rank, chunk))
    lora = workload.lora
    head = head_bytes(model, layout, x, lora is not None) if is_last(layout, pp_rank, chunk) else 0
    forward = head + (embedding_bytes(layout, x) if is_first(layout, pp_rank, chunk) else 0)

    def lora_delta(group: list[int]) -> int:
        # under full recompute the embedding's output is made to need a gradient (core.modeling.lora)
        first = layout.recompute != "full"
        return sum(lora_bytes(model, layout, x, lora, n, first and n == 0) for n in group) if lora is not None else 0

    recompute = 0
    if layout.recompute == "full":
        g = layout.recompute_num_layers
        checkpoint_input = x.s_norm * x.b * model.hidden_size * x.e
        forward += len(layers) // g * checkpoint_input
        groups = [layers[i:i + g] for i in range(0, len(layers), g)]
        # the first norm saves the checkpoint's input itself (already held) unless it keeps a bf16 input's fp32 copy
        shared_input = checkpoint_input if x.e == FP32 or not decomposed_norm(model, x) else 0
        recompute = max(sum(layer_bytes(model, layout, x, n) for n in group) + lora_delta(group)
                        for group in groups) - shared_input
    else:
        forward += sum(layer_bytes(model, layout, x, n) for n in layers) + lora_delta(layers)
    return Chunk(forward=forward, head=head, recompute=recompute)


def schedule(layout: Layout, micro_batches: int, pp_rank: int) -> list[tuple[str, int]]:
    """Megatron-Core 0.16's order of ("F" | "B", model chunk) on pipeline rank `pp_rank`: one micro-batch after the
    other without PP, 1F1B (warm-up of PP - rank - 1 forwards), or the interleaved schedule (warm-up of
    2 (PP - rank - 1) + (VPP - 1) PP, chunks taken in groups of PP micro-batches: `get_schedule_table`)."""
    pp, vpp = layout.pp, layout.vpp or 1
    if pp == 1:
        return [op for _ in range(micro_batches) for op in (("F", 0), ("B", 0))]
    group = pp
    table = []
    for start in range(0, micro_batches, group):
        end = micro_batches if start + group >= micro_batches else start + group
        table += [c for c in range(vpp) for _ in range(start, end)]
    total = micro_batches * vpp
    warmup = (pp - pp_rank - 1) if vpp == 1 else (pp - pp_rank - 1) * 2 + (vpp - 1) * group
    warmup = min(warmup, total)
    ops = [("F", table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [("F", table[k + warmup]), ("B", vpp - 1 - table[k])]
    ops += [("B", vpp - 1 - table[k]) for k in range(total - warmup, total)]
    return ops


def peak_bytes(model: ModelConfig, layout: Layout, workload: Workload, world: int, pp_rank: int) -> tuple[int, int]:
    """(peak saved activations, micro-batch chunks in flight at it) on a rank of pipeline stage `pp_rank`: the
    schedule played forward, each forward adding its chunk's saved bytes, each backward freeing them after its
    recomputation (if any) peaked."""
    chunks = [chunk_bytes(model, layout, workload, pp_rank, c) for c in range(layout.vpp or 1)]
    x = dims(layout, workload)
    # full recompute saves the rotary frequencies with every checkpoint: one tensor, cached by Megatron-Core's
    # RotaryEmbedding for every micro-batch and chunk of the rank
    live = x.s * model.head_dim * FP32 if layout.recompute == "full" and model.position_embedding_type == "rope" else 0
    in_flight = peak = peak_in_flight = 0
    for op, c in schedule(layout, workload.micro_batches(layout, world), pp_rank):
        chunk = chunks[c]
        if op == "F":
            live, in_flight = live + chunk.forward, in_flight + 1
            now = live
        else:
            now = live - chunk.head + chunk.recompute
            live, in_flight = live - chunk.forward, in_flight - 1
        if now > peak:
            peak, peak_in_flight = now, in_flight + (op == "B")
    return peak, peak_in_flight
