"""Every tensor a Hugging Face checkpoint of a model must hold, with its shape (`expected_hf_shapes`), by family: what
`core.checkpoints.hf_checkpoint` checks a download against before any conversion starts. The names are those of
`core.checkpoints.hf_mapping`'s rules."""

from __future__ import annotations

from pai_cookbook.core.checkpoints.hf_mapping import _DENSE_NAMES, _MOE_NAMES, STACKED_EXPERTS
from pai_cookbook.core.configs.config import ModelConfig


def expected_hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `model` must hold, with its shape."""
    h, layers = model.hidden_size, model.num_layers
    if model.family == "qwen3_next":
        return _qwen3_next_shapes(model)
    if model.is_hybrid:
        return _hybrid_shapes(model)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,)}
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    flags = model.moe_flags
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if model.post_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        shapes |= _mla_shapes(model, p) if model.multi_latent_attention else _attention_shapes(model, p)
        shapes |= _mlp_shapes(model, p, model.is_moe and flags[i])
    return shapes


def _mlp_shapes(model: ModelConfig, p: str, is_moe: bool) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors under prefix `p`: a dense SwiGLU, or the router, experts and shared expert (with its gate)
    of a mixture of experts, by the family's names."""
    h, names = model.hidden_size, _MOE_NAMES.get(model.family, _DENSE_NAMES)
    if not is_moe:
        f = model.ffn_hidden_size
        return {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    f, moe = model.moe_ffn_hidden_size or model.ffn_hidden_size, names["moe"]
    shapes = {p + f"{moe}.{names['router']}.weight": (model.num_experts, h)}
    if model.family in STACKED_EXPERTS:
        return shapes | _stacked_expert_shapes(model, p, f)
    for e in range(model.num_experts):
        x = p + f"{moe}.experts.{e}."
        shapes |= {x + f"{names['gate']}.weight": (f, h), x + f"{names['up']}.weight": (f, h),
                   x + f"{names['down']}.weight": (h, f)}
    if model.moe_router_enable_expert_bias:
        shapes[p + f"{moe}.gate.e_score_correction_bias"] = (model.num_experts,)
    if model.moe_shared_expert_intermediate_size:
        s, x = model.moe_shared_expert_intermediate_size, p + f"mlp.{names['shared']}."
        shapes |= {x + "gate_proj.weight": (s, h), x + "up_proj.weight": (s, h), x + "down_proj.weight": (h, s)}
        if model.moe_shared_expert_gate:
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def _stacked_expert_shapes(model: ModelConfig, p: str, f: int) -> dict[str, tuple[int, ...]]:
    """GPT-OSS's router bias and stacked experts ([experts, in, out], with biases)."""
    e, h = model.num_experts, model.hidden_size
    x = p + "mlp.experts."
    return {p + "mlp.router.bias": (e,), x + "gate_up_proj": (e, h, 2 * f), x + "gate_up_proj_bias": (e, 2 * f),
            x + "down_proj": (e, f, h), x + "down_proj_bias": (e, h)}


def _attention_shapes(model: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, d = model.hidden_size, model.head_dim
    q_out, kv_out = model.num_attention_heads * d, model.query_groups * d
    shapes = {p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
              p + "self_attn.v_proj.weight": (kv_out, h), p + "self_attn.o_proj.weight": (h, q_out)}
    if model.add_qkv_bias or model.add_bias_linear:
        shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                   p + "self_attn.v_proj.bias": (kv_out,)}
    if model.add_bias_linear:
        shapes[p + "self_attn.o_proj.bias"] = (h,)
    if model.attention_sinks:
        shapes[p + "self_attn.sinks"] = (model.num_attention_heads,)
    if model.qk_layernorm:
        shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _mla_shapes(model: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's attention tensors: query latent (or a direct query projection), key/value latent with the shared
    rotary key, their norms, the per-head up-projections and the output."""
    h, heads, a = model.hidden_size, model.num_attention_heads, p + "self_attn."
    q_head, latent = model.qk_head_dim + model.qk_pos_emb_head_dim, model.kv_lora_rank
    shapes = {a + "kv_a_proj_with_mqa.weight": (latent + model.qk_pos_emb_head_dim, h),
              a + "kv_a_layernorm.weight": (latent,),
              a + "kv_b_proj.weight": (heads * (model.qk_head_dim + model.v_head_dim), latent),
              a + "o_proj.weight": (h, heads * model.v_head_dim)}
    if model.q_lora_rank is None:
        return shapes | {a + "q_proj.weight": (heads * q_head, h)}
    return shapes | {a + "q_a_proj.weight": (model.q_lora_rank, h), a + "q_a_layernorm.weight": (model.q_lora_rank,),
                     a + "q_b_proj.weight": (heads * q_head, model.q_lora_rank)}


def _hybrid_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A hybrid model's tensors (Nemotron-H): per layer one norm and its mixer's (Mamba-2, attention or MLP)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    shapes = {"backbone.embeddings.weight": (model.vocab_size, h), "backbone.norm_f.weight": (h,)}
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    heads, inner, conv = model.mamba_num_heads, model.mamba_inner, model.mamba_conv_channels
    for i, kind in enumerate(model.hybrid_pattern):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (h,)
        if kind == "M":
            m = p + "mixer."
            shapes |= {m + "in_proj.weight": (inner + conv + heads, h), m + "conv1d.weight": (conv, 1, model.mamba_conv_kernel),
                       m + "conv1d.bias": (conv,), m + "dt_bias": (heads,), m + "A_log": (heads,), m + "D": (heads,),
                       m + "norm.weight": (inner,), m + "out_proj.weight": (h, inner)}
        elif kind == "*":
            shapes |= {k.replace("self_attn.", "mixer."): v for k, v in _attention_shapes(model, p).items()}
        else:
            shapes |= {p + "mixer.up_proj.weight": (f, h), p + "mixer.down_proj.weight": (h, f)}
    return shapes


def _qwen3_next_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's tensors: per layer its gated DeltaNet or gated attention, then its experts or dense MLP."""
    h, value_heads, qk, v = model.hidden_size, model.gdn_value_heads, model.gdn_key_dim, model.gdn_value_dim
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h), "model.norm.weight": (h,)}
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    for i in range(model.num_layers // 2):
        p, d = f"model.layers.{i}.", f"model.layers.{i}.linear_attn."
        mixer, mlp = model.hybrid_pattern[2 * i:2 * i + 2]
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if mixer == "G":
            shapes |= {d + "in_proj_qkvz.weight": (2 * qk + 2 * v, h), d + "in_proj_ba.weight": (2 * value_heads, h),
                       d + "conv1d.weight": (2 * qk + v, 1, model.gdn_conv_kernel), d + "dt_bias": (value_heads,),
                       d + "A_log": (value_heads,), d + "norm.weight": (model.gdn_value_head_dim,),
                       d + "out_proj.weight": (h, v)}
        else:
            gated = _attention_shapes(model, p)
            gated[p + "self_attn.q_proj.weight"] = (2 * model.num_attention_heads * model.head_dim, h)
            shapes |= gated
        shapes |= _mlp_shapes(model, p, mlp == "E")
    return shapes
