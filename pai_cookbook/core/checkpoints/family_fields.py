"""How each model family's Hugging Face config keys become `ModelConfig` fields, and back (`core.checkpoints.families` holds the
registry that uses them).

Reading goes through a transformers config object, so legacy keys arrive normalised. What Megatron-Core cannot express
exactly is refused with the reason and, where there is one, the fix; nothing is approximated.
"""

from __future__ import annotations

from typing import Any

from pai_cookbook.core.configs.config import ConfigError, ModelConfig

# Families whose YaRN rotary multi-latent attention builds (the others' is GPTModel's `position_embedding_type="yarn"`).
LATENT_YARN_FAMILIES = {"deepseek_v3"}
# Megatron-Core's Llama 3 rotary scaling has these constants built in (rotary_pos_embedding._apply_scaling).
MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def dense_read(hf: Any) -> dict[str, Any]:
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ConfigError(f"{hf.model_type}: attention_bias/mlp_bias=True (bias on every projection) is not "
                          f"supported by the cookbook's Megatron-Core mapping; only QKV bias is (Qwen2).")
    return {}


def no_sliding_window(hf: Any) -> dict[str, Any]:
    if getattr(hf, "use_sliding_window", False):
        raise ConfigError(f"{hf.model_type}: use_sliding_window=True (sliding-window attention on layers from "
                          f"max_window_layers={getattr(hf, 'max_window_layers', None)}) is not supported; every released "
                          f"Qwen3 checkpoint has it off. Set it to false in config.json if this one does not use it.")
    return {}


def rotary(hf: Any) -> dict[str, Any]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    out = {"rotary_base": float(params.get("rope_theta", 10000.0))}
    if (partial := params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))) not in (None, 1.0):
        out["rotary_percent"] = float(partial)  # the first part of each head rotates, as Megatron-Core's rotary_percent
    if rope_type == "default":
        return out
    if rope_type == "llama3":
        mismatched = {k: params.get(k) for k, v in MCORE_LLAMA3_ROPE.items() if float(params.get(k, v)) != v}
        if mismatched:
            raise ConfigError(f"llama3 rotary scaling with {mismatched} differs from Megatron-Core's built-in "
                              f"{MCORE_LLAMA3_ROPE}; this checkpoint's positions cannot be reproduced exactly.")
        return out | {"rope_scaling_factor": float(params["factor"])}
    if rope_type == "yarn":
        latent = hf.model_type in LATENT_YARN_FAMILIES
        if not latent and out.get("rotary_percent", 1.0) != 1.0:
            raise ConfigError(f"{hf.model_type}: yarn rotary scaling of part of each head (partial_rotary_factor "
                              f"{out['rotary_percent']}) is not reproduced yet; this checkpoint's positions would differ.")
        return out | {"yarn": yarn(params, hf, unrounded=not latent)}
    raise ConfigError(f"rotary scaling rope_type={rope_type!r} is not supported; supported: 'default', 'llama3', "
                      f"'yarn'.")


def yarn(params: dict[str, Any], hf: Any, unrounded: bool = False) -> dict[str, float]:
    """YaRN's fields as Megatron-Core takes them (`ModelConfig.yarn`), from HF rope_parameters.

    HF scales cos/sin by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set, else by
    get_mscale(factor); Megatron-Core always takes the ratio. Both set, or mscale_all_dim unset (then mscale=1,
    mscale_all_dim=0 gives HF's get_mscale(factor)), reproduce HF; anything else is refused. `truncate` (transformers
    rounds the correction range to whole dimensions unless it is false, as GPT-OSS's is) is kept where `unrounded`
    (GPTModel's YaRN takes it), refused otherwise."""
    refused = {k: params[k] for k in ("attention_factor",) if params.get(k) is not None}
    truncate = bool(params.get("truncate", True))  # as transformers reads it: 0 and null do not round
    if not truncate and not unrounded:
        refused["truncate"] = False
    original = params.get("original_max_position_embeddings") or hf.max_position_embeddings
    factor = params.get("factor") or hf.max_position_embeddings / original
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        refused |= {"mscale": mscale, "mscale_all_dim": all_dim}
    if refused:
        raise ConfigError(f"{hf.model_type}: yarn rotary scaling with {refused} has no Megatron-Core equivalent (its "
                          f"YaRN takes factor, original_max_position_embeddings, beta_fast, beta_slow, and mscale with "
                          f"mscale_all_dim together); this checkpoint's positions cannot be reproduced exactly.")
    both = bool(mscale and all_dim)
    return {"factor": float(factor), "original_max_position_embeddings": int(original),
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "mscale": float(mscale) if both else 1.0, "mscale_all_dim": float(all_dim) if both else 0.0} | (
        {"truncate": int(truncate)} if unrounded else {})


def grouped_sigmoid_router(hf: Any) -> dict[str, Any]:
    """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, a per-expert bias added for the choice only
    (e_score_correction_bias: Megatron-Core's expert_bias), top-k within the best `topk_group` of `n_group` groups,
    the chosen scores normalised and scaled by routed_scaling_factor; `n_shared_experts` always-on experts; the
    first `first_k_dense_replace` layers dense."""
    if not hf.norm_topk_prob and hf.num_experts_per_tok > 1:
        raise ConfigError(f"{hf.model_type}: norm_topk_prob=False; Megatron-Core's sigmoid router always normalises "
                          f"the top-{hf.num_experts_per_tok} scores, so this router cannot be reproduced.")
    dense = hf.first_k_dense_replace or 0
    grouped = (hf.n_group or 1) > 1
    if grouped and hf.num_experts_per_tok != 2 * hf.topk_group:
        raise ConfigError(f"{hf.model_type}: group-limited routing with num_experts_per_tok={hf.num_experts_per_tok} "
                          f"and topk_group={hf.topk_group}; transformers scores a group by its best 2 experts, "
                          f"Megatron-Core by its best num_experts_per_tok / topk_group, the same only where "
                          f"num_experts_per_tok = 2 x topk_group (DeepSeek-V3: 8 = 2 x 4).")
    shared = (hf.n_shared_experts or 0) * hf.moe_intermediate_size
    return {"num_experts": hf.n_routed_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size, "moe_shared_expert_intermediate_size": shared or None,
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": hf.n_group if grouped else None,
            "moe_router_group_topk": hf.topk_group if grouped else None,
            "moe_router_topk_scaling_factor": hf.routed_scaling_factor if hf.routed_scaling_factor != 1 else None,
            "moe_layer_freq": [0] * dense + [1] * (hf.num_hidden_layers - dense) if dense else 1}


def grouped_sigmoid_router_hf(m: ModelConfig) -> dict[str, Any]:
    flags = m.moe_flags
    dense = flags.index(True) if any(flags) else None
    shared = m.moe_shared_expert_intermediate_size or 0
    if dense is None or flags != [False] * dense + [True] * (m.num_layers - dense) or shared % m.moe_ffn_hidden_size:
        raise ConfigError(f"{m.family} places dense layers first only (first_k_dense_replace) and shared experts as a "
                          f"whole number of routed experts' widths; moe_layer_freq={m.moe_layer_freq} and shared width "
                          f"{shared} (expert width {m.moe_ffn_hidden_size}) cannot be written.")
    return {"n_routed_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size, "n_shared_experts": shared // m.moe_ffn_hidden_size,
            "n_group": m.moe_router_num_groups or 1, "topk_group": m.moe_router_group_topk or 1,
            "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0, "norm_topk_prob": True,
            "first_k_dense_replace": dense}


# DeepSeek-V3 builds its query/key-value latent norms with eps 1e-6 whatever rms_norm_eps says; Megatron-Core has one.
DEEPSEEK_LATENT_NORM_EPS = 1e-6


def deepseek_v3_read(hf: Any) -> dict[str, Any]:
    if getattr(hf, "attention_bias", False):
        raise ConfigError("deepseek_v3: attention_bias=True (biases on the latent projections) is not built by "
                          "Megatron-Core's multi-latent attention; every released DeepSeek-V3 checkpoint has it off.")
    if not getattr(hf, "rope_interleave", True):
        raise ConfigError("deepseek_v3: rope_interleave=False; Megatron-Core's multi-latent attention rotates "
                          "interleaved pairs, as every released DeepSeek-V3 checkpoint does.")
    if hf.rms_norm_eps != DEEPSEEK_LATENT_NORM_EPS:
        raise ConfigError(f"deepseek_v3: rms_norm_eps={hf.rms_norm_eps}; transformers builds the latent norms with "
                          f"{DEEPSEEK_LATENT_NORM_EPS} whatever it says and Megatron-Core uses one epsilon for every "
                          f"norm, so only rms_norm_eps={DEEPSEEK_LATENT_NORM_EPS} (DeepSeek-V3's) is reproduced.")
    if getattr(hf, "quantization_config", None):
        raise ConfigError(f"deepseek_v3: the checkpoint is quantized ({hf.quantization_config.get('quant_method')}, "
                          f"DeepSeek-V3's FP8 blocks with weight_scale_inv tensors); the cookbook converts bf16/fp32 "
                          f"weights. Dequantize it to bf16 first (DeepSeek's inference/fp8_cast_bf16.py) and drop "
                          f"quantization_config from config.json.")
    return grouped_sigmoid_router(hf) | {
        "multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": hf.q_lora_rank,
        "kv_lora_rank": hf.kv_lora_rank, "qk_head_dim": hf.qk_nope_head_dim, "qk_pos_emb_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim, "kv_channels": hf.qk_nope_head_dim + hf.qk_rope_head_dim}


def deepseek_v3_write(m: ModelConfig) -> dict[str, Any]:
    return grouped_sigmoid_router_hf(m) | {
        "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_head_dim,
        "qk_rope_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim, "rope_interleave": True,
        "num_key_value_heads": m.num_attention_heads, "head_dim": m.qk_pos_emb_head_dim}


def moe_layers(hf: Any) -> int | list[int]:
    """HF places MoE at layers with (i+1) % decoder_sparse_step == 0, minus mlp_only_layers."""
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(hf, "mlp_only_layers", None) or [])
    pattern = [int((i + 1) % step == 0 and i not in dense_only) for i in range(hf.num_hidden_layers)]
    return 1 if all(pattern) else pattern


def moe_layers_hf(model: ModelConfig) -> dict[str, Any]:
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(model.moe_flags) if not moe]}


def glm4_moe_read(hf: Any) -> dict[str, Any]:
    """GLM-4.5: grouped-query attention with a bias on q, k and v (attention_bias), optional per-head q/k norms, half of
    each head rotating, and DeepSeek-V3's router (`grouped_sigmoid_router`)."""
    return grouped_sigmoid_router(hf) | {"add_qkv_bias": bool(hf.attention_bias), "qk_layernorm": bool(hf.use_qk_norm)}


def glm4_moe_write(m: ModelConfig) -> dict[str, Any]:
    return grouped_sigmoid_router_hf(m) | {"attention_bias": m.add_qkv_bias, "use_qk_norm": m.qk_layernorm}


def window_layers(hf: Any) -> list[int]:
    """`ModelConfig.sliding_window_layers` of a config's `layer_types` (Gemma 3's, GPT-OSS's): 1 for a sliding-window
    layer, 0 for a full one; any other kind refused."""
    kinds = list(hf.layer_types)
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"{hf.model_type}: layer types {unknown}; the cookbook builds sliding_attention and "
                          f"full_attention layers.")
    return [int(kind == "sliding_attention") for kind in kinds]


def layer_types(m: ModelConfig) -> list[str]:
    """`layer_types` of `m.sliding_window_layers`: `window_layers`' inverse."""
    return ["sliding_attention" if flag else "full_attention" for flag in m.sliding_window_layers]


def gemma3_read(hf: Any) -> dict[str, Any]:
    """Gemma 3's text model (`gemma3_text`): sliding-window layers with their own rotary base beside full-attention
    ones (whose rotary may be linearly scaled), queries scaled by `query_pre_attn_scalar`, (1 + w) norms on the
    attention's and the MLP's outputs too, gated GELU (tanh), embeddings times sqrt(hidden). What the cookbook
    cannot reproduce exactly is refused."""
    refused = {"use_bidirectional_attention": getattr(hf, "use_bidirectional_attention", False),
               "final_logit_softcapping": getattr(hf, "final_logit_softcapping", None),
               "attention_bias": getattr(hf, "attention_bias", False)}
    set_ = {k: v for k, v in refused.items() if v}
    if set_:
        raise ConfigError(f"gemma3_text with {set_}: the cookbook builds Gemma 3 without them (every released Gemma "
                          f"3 text model has them off); this checkpoint's outputs cannot be reproduced exactly.")
    activation = getattr(hf, "hidden_activation", "gelu_pytorch_tanh")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"gemma3_text: hidden_activation={activation!r}; the cookbook maps Gemma's gelu_pytorch_tanh.")
    rope = hf.rope_parameters
    local, full = rope.get("sliding_attention", {}), rope.get("full_attention", {})
    if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default", "linear"):
        raise ConfigError(f"gemma3_text rotary {rope}: the cookbook builds default rotary on sliding layers and "
                          f"default or linear on full ones.")
    factor = full.get("factor") if full.get("rope_type") == "linear" else None
    return {"activation": "geglu", "qk_layernorm": True, "norm_plus_one": True, "post_norms": True,
            "embedding_multiplier": hf.hidden_size ** 0.5, "query_pre_attn_scalar": hf.query_pre_attn_scalar,
            "sliding_window": hf.sliding_window,
            "sliding_window_layers": window_layers(hf),
            "rotary_base": float(full.get("rope_theta", 1e6)), "local_rotary_base": float(local.get("rope_theta", 1e4)),
            "rotary_linear_factor": None if factor is None else float(factor)}


def gemma3_write(m: Any) -> dict[str, Any]:
    full = {"rope_type": "default", "rope_theta": m.rotary_base} if m.rotary_linear_factor is None else \
        {"rope_type": "linear", "rope_theta": m.rotary_base, "factor": m.rotary_linear_factor}
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": m.query_pre_attn_scalar,
            "sliding_window": m.sliding_window, "final_logit_softcapping": None, "use_bidirectional_attention": False,
            "layer_types": layer_types(m),
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": m.local_rotary_base},
                                "full_attention": full}}


# GPT-OSS's gate activation is x * sigmoid(swiglu_alpha * x); Megatron-Core's quick_gelu has 1.702 built in.
GPT_OSS_ALPHA = 1.702


def gpt_oss_read(hf: Any) -> dict[str, Any]:
    """GPT-OSS: biases on every attention projection, the router and the experts; a learned sink per head; layers
    alternating a sliding window with full attention (`layer_types`); YaRN; every layer a mixture of experts whose
    router takes a softmax over its top-k logits and whose experts gate by x * sigmoid(1.702 x), clamped at
    swiglu_limit, the linear half plus one. Released checkpoints store the experts in MXFP4, dequantized on
    conversion (`core.checkpoints.mxfp4`)."""
    quantization = getattr(hf, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    if method not in (None, "mxfp4"):
        raise ConfigError(f"gpt_oss: quantization_config quant_method={method!r}; the cookbook converts bf16/fp32 "
                          f"weights and the released MXFP4 experts. Dequantize it first.")
    alpha = getattr(hf, "swiglu_alpha", GPT_OSS_ALPHA)
    if alpha != GPT_OSS_ALPHA:
        raise ConfigError(f"gpt_oss: swiglu_alpha={alpha}; Megatron-Core's quick GELU has {GPT_OSS_ALPHA} built in "
                          f"(every released GPT-OSS's), so this checkpoint's MLPs cannot be reproduced exactly.")
    if not hf.attention_bias:
        raise ConfigError("gpt_oss: attention_bias=False; Megatron-Core gives the router and the experts biases "
                          "together with the attention's (add_bias_linear), as every released GPT-OSS has them.")
    return {"activation": "quick_geglu", "glu_clamp": float(hf.swiglu_limit), "glu_linear_offset": 1.0,
            "attention_sinks": True, "add_bias_linear": True, "sliding_window": hf.sliding_window,
            "sliding_window_layers": window_layers(hf),
            "num_experts": hf.num_local_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.intermediate_size, "moe_aux_loss_coeff": 0.0,
            "moe_router_load_balancing_type": "none"}


def gpt_oss_write(m: Any) -> dict[str, Any]:
    rope = {"rope_type": "default", "rope_theta": m.rotary_base}
    if m.yarn is not None:  # the keys a GPT-OSS config.json has (mscale's are Megatron-Core's spelling of their absence)
        rope |= {"rope_type": "yarn", "truncate": bool(m.yarn.get("truncate", 1))} | {
            k: m.yarn[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}
    return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "intermediate_size": m.moe_ffn_hidden_size, "swiglu_limit": m.glu_clamp, "attention_bias": True,
            "sliding_window": m.sliding_window, "rope_parameters": rope,
            "layer_types": layer_types(m)}


def nemotron_h_read(hf: Any) -> dict[str, Any]:
    """Nemotron-H: a hybrid of Mamba-2 ("M"), attention ("*") and MLP ("-") layers in the order of its pattern, each
    one mixer after one RMSNorm; attention without positions (no rotary), MLPs of squared ReLU without a gate, no
    biases. Its mixture-of-experts layers ("E", Nemotron 3) and multi-token prediction are refused by name."""
    pattern = hf.hybrid_override_pattern
    if "E" in pattern or getattr(hf, "num_nextn_predict_layers", 0):
        raise ConfigError(f"nemotron_h: pattern {pattern!r} with mixture-of-experts layers ('E') or multi-token "
                          f"prediction (num_nextn_predict_layers {getattr(hf, 'num_nextn_predict_layers', 0)}): the "
                          f"cookbook builds Nemotron-H's Mamba-2, attention and dense MLP layers ('M', '*', '-') only.")
    wanted = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
              "mlp_bias": False, "attention_bias": False}
    found = {k: getattr(hf, k, v) for k, v in wanted.items()}
    if found != wanted:
        raise ConfigError(f"nemotron_h: {sorted(set(found.items()) - set(wanted.items()))}; Megatron-Core's hybrid "
                          f"layers build {wanted} (every released Nemotron-H's).")
    return {"hybrid_pattern": pattern, "num_layers": len(pattern), "position_embedding_type": "none",
            "activation": "squared_relu", "norm_epsilon": hf.layer_norm_epsilon,
            "mamba_num_heads": hf.mamba_num_heads, "mamba_head_dim": hf.mamba_head_dim,
            "mamba_state_dim": hf.ssm_state_size, "mamba_num_groups": hf.n_groups,
            "mamba_conv_kernel": hf.conv_kernel, "mamba_chunk_size": hf.chunk_size}


def nemotron_h_write(m: ModelConfig) -> dict[str, Any]:
    return {"hybrid_override_pattern": m.hybrid_pattern, "layer_norm_epsilon": m.norm_epsilon,
            "mamba_num_heads": m.mamba_num_heads, "mamba_head_dim": m.mamba_head_dim, "ssm_state_size": m.mamba_state_dim,
            "n_groups": m.mamba_num_groups, "conv_kernel": m.mamba_conv_kernel, "chunk_size": m.mamba_chunk_size,
            "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
            "mlp_bias": False, "attention_bias": False}


def qwen3_next_read(hf: Any) -> dict[str, Any]:
    """Qwen3-Next: each layer a gated DeltaNet ("linear_attention") or gated full attention (`layer_types`), then a
    mixture of experts (or, for `mlp_only_layers`, a dense MLP), as Megatron-Core's hybrid stack builds them: two layers
    of its pattern per layer, "G" or "*", then "E" or "-". (1 + w) norms, per-head q/k norms, a quarter of each head
    rotating, experts routed by a softmax over all of them with a gated shared expert."""
    moe = [hf.num_experts > 0 and i not in (hf.mlp_only_layers or []) and (i + 1) % hf.decoder_sparse_step == 0
           for i in range(hf.num_hidden_layers)]
    pattern = "".join(("G" if kind == "linear_attention" else "*") + ("E" if expert else "-")
                      for kind, expert in zip(hf.layer_types, moe))
    fields = {"hybrid_pattern": pattern, "num_layers": len(pattern), "norm_plus_one": True, "qk_layernorm": True,
              "attention_output_gate": True, "gdn_key_heads": hf.linear_num_key_heads,
              "gdn_value_heads": hf.linear_num_value_heads, "gdn_key_head_dim": hf.linear_key_head_dim,
              "gdn_value_head_dim": hf.linear_value_head_dim, "gdn_conv_kernel": hf.linear_conv_kernel_dim}
    if any(moe):
        fields |= {"num_experts": hf.num_experts, "moe_router_topk": hf.num_experts_per_tok,
                   "moe_ffn_hidden_size": hf.moe_intermediate_size,
                   "moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
                   "moe_shared_expert_gate": True, "moe_router_pre_softmax": not hf.norm_topk_prob,
                   "moe_aux_loss_coeff": hf.router_aux_loss_coef}
    return fields


def qwen3_next_write(m: ModelConfig) -> dict[str, Any]:
    pairs = [m.hybrid_pattern[i:i + 2] for i in range(0, len(m.hybrid_pattern), 2)]
    out = {"num_hidden_layers": len(pairs),
           "layer_types": ["linear_attention" if p[0] == "G" else "full_attention" for p in pairs],
           "mlp_only_layers": [i for i, p in enumerate(pairs) if p[1] == "-"], "decoder_sparse_step": 1,
           "linear_num_key_heads": m.gdn_key_heads, "linear_num_value_heads": m.gdn_value_heads,
           "linear_key_head_dim": m.gdn_key_head_dim, "linear_value_head_dim": m.gdn_value_head_dim,
           "linear_conv_kernel_dim": m.gdn_conv_kernel}
    if m.is_moe:
        out |= {"num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
                "moe_intermediate_size": m.moe_ffn_hidden_size,
                "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
                "norm_topk_prob": not m.moe_router_pre_softmax, "router_aux_loss_coef": m.moe_aux_loss_coeff}
    return out


def json_floats(value: Any) -> Any:
    """A config.json value with transformers' spelling of the floats JSON lacks (`{"__float__": "Infinity"}`, as in
    Nemotron-H's time_step_limit) read back as floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].replace("Infinity", "inf"))
        return {k: json_floats(v) for k, v in value.items()}
    return [json_floats(v) for v in value] if isinstance(value, list) else value
