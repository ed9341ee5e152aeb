"""Model families: Hugging Face `config.json` <-> the cookbook's `ModelConfig` (and so Megatron-Core).

A family is a Hugging Face `model_type`. Reading goes through `transformers.AutoConfig`, so the legacy
keys of real downloads (`rope_theta`, `rope_scaling`, ...) arrive normalised; writing builds the
family's own transformers config class, so `save_pretrained` output loads with `AutoModelForCausalLM`.
What Megatron-Core cannot express (other rotary scalings, biases on every attention projection)
is refused with a message, never approximated.

Supported: Llama 2/3 (MHA and GQA), Qwen2/Qwen2.5, Qwen3 (QK norm, a head width of its own), Mistral, Mixtral,
Qwen2-MoE (shared expert with gate), Qwen3-MoE (QK norm), DeepSeek-V3 (multi-latent attention, YaRN, grouped
sigmoid routing with an expert bias, a shared expert, dense first layers; its multi-token-prediction layer is refused
by name: `core.checkpoints.hf_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import family_fields
from pai_cookbook.core.configs.config import ConfigError, ModelConfig
from pai_cookbook.core.launching import inputs


@dataclass(frozen=True)
class Family:
    """One Hugging Face model type and how its config maps onto `ModelConfig`."""

    name: str
    """Hugging Face model_type, also the registry key."""
    architecture: str
    """Hugging Face model class written into config.json `architectures`."""
    read: Callable[[Any], dict[str, Any]]
    """Family-specific ModelConfig fields from a transformers config object."""
    write: Callable[[ModelConfig], dict[str, Any]]
    """Family-specific transformers config kwargs from a ModelConfig."""
    tiny: dict[str, Any] = field(default_factory=dict)
    """Extra transformers kwargs for the family's tiny test model."""
    activation_key: str = "hidden_act"
    """The config.json key of the MLP's activation: "silu" there, checked and written; another key (Gemma's
    `hidden_activation`, GPT-OSS's `swiglu_limit`, whose `hidden_act` is unused) is `read`'s to check."""
    not_keys: tuple[str, ...] = ()
    """The transformer fields `to_hf` writes that this family's config does not have (a hybrid's rotary and
    rms_norm_eps): left out of its config.json."""


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", read=family_fields.dense_read, write=lambda m: {}),
    "mistral": Family(
        "mistral", "MistralForCausalLM",
        read=lambda hf: family_fields.dense_read(hf) | {"sliding_window": getattr(hf, "sliding_window", None)},
        write=lambda m: {"sliding_window": m.sliding_window},
        tiny={"sliding_window": 8},  # shorter than the tests' sequences: the window is applied, not only fitted
    ),
    "qwen2": Family(
        "qwen2", "Qwen2ForCausalLM",
        # Qwen2 puts a bias on q, k and v (not on o or the MLP).
        read=lambda hf: {"add_qkv_bias": True},
        write=lambda m: {},
        tiny={"tie_word_embeddings": True},
    ),
    "qwen3": Family(
        "qwen3", "Qwen3ForCausalLM",
        # Qwen3: RMSNorm on each head's queries and keys; head_dim set apart from hidden / heads (Qwen3-32B: 5,120 /
        # 64 heads = 80, head_dim 128), so the tiny model's is odd too (24 against 64 / 4 = 16).
        read=lambda hf: family_fields.no_sliding_window(hf) | family_fields.dense_read(hf) | {"qk_layernorm": True},
        write=lambda m: {"use_sliding_window": False},
        tiny={"head_dim": 24},
    ),
    "deepseek_v3": Family(
        "deepseek_v3", "DeepseekV3ForCausalLM", read=family_fields.deepseek_v3_read, write=family_fields.deepseek_v3_write,
        # DeepSeek-V3's shapes, shrunk and made uneven: value heads (20) narrower than query/key heads (24 + 16), a
        # query latent (48) apart from the key/value latent (32), 16 experts in 4 groups of which a token may use 2
        # (its top 4 within them; DeepSeek-V3: top 8 within 4 of 8 groups of 32), a shared expert, the first layer
        # dense, routed weights x 2.5, and YaRN (x4 over 64 positions) with its attention scale, as DeepSeek-V3's 128k
        # context has (x40 over 4,096).
        tiny={"num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 24,
              "qk_rope_head_dim": 16, "v_head_dim": 20, "n_routed_experts": 16, "num_experts_per_tok": 4,
              "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "mscale": 1.0, "mscale_all_dim": 1.0}},
    ),
    "glm4_moe": Family(
        "glm4_moe", "Glm4MoeForCausalLM", read=family_fields.glm4_moe_read, write=family_fields.glm4_moe_write,
        # GLM-4.5's shapes, shrunk: heads 24 wide (GLM-4.5: 128 where hidden / heads is 53), half of each rotating,
        # biases on q, k and v, per-head q/k norms (GLM-4.5-Air has them off), the first layer dense, and DeepSeek-V3's
        # router: 8 experts in one group (as GLM-4.5), top-2, an expert bias, routed weights x 2.5, a shared expert.
        tiny={"head_dim": 24, "attention_bias": True, "use_qk_norm": True, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
    "mixtral": Family(
        "mixtral", "MixtralForCausalLM",
        read=lambda hf: {
            "num_experts": hf.num_local_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.intermediate_size, "moe_aux_loss_coeff": hf.router_aux_loss_coef,
        },
        write=lambda m: {"num_local_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
                         "router_aux_loss_coef": m.moe_aux_loss_coeff},
        tiny={"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen2_moe": Family(
        "qwen2_moe", "Qwen2MoeForCausalLM",
        read=lambda hf: {
            "add_qkv_bias": True, "num_experts": hf.num_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": hf.shared_expert_intermediate_size,
            "moe_shared_expert_gate": True, "moe_router_pre_softmax": not hf.norm_topk_prob,
            "moe_layer_freq": family_fields.moe_layers(hf), "moe_aux_loss_coeff": hf.router_aux_loss_coef,
        },
        write=lambda m: {
            "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
            "norm_topk_prob": not m.moe_router_pre_softmax, "router_aux_loss_coef": m.moe_aux_loss_coeff,
        } | family_fields.moe_layers_hf(m),
        tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
              "shared_expert_intermediate_size": 96},
    ),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM",
        read=lambda hf: family_fields.dense_read(hf) | {
            "qk_layernorm": True, "num_experts": hf.num_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size, "moe_router_pre_softmax": not hf.norm_topk_prob,
            "moe_layer_freq": family_fields.moe_layers(hf), "moe_aux_loss_coeff": hf.router_aux_loss_coef,
        },
        write=lambda m: {
            "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size, "norm_topk_prob": not m.moe_router_pre_softmax,
            "router_aux_loss_coef": m.moe_aux_loss_coeff,
        } | family_fields.moe_layers_hf(m),
        tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    ),
    # Gemma 3's text model: 2 layers, one of each kind; a window shorter than the tests' sequences, a linear rotary
    # factor on the full layer, and a query scale other than the head width's, so each is applied, not only read
    "gemma3_text": Family(
        "gemma3_text", "Gemma3ForCausalLM", read=family_fields.gemma3_read, write=family_fields.gemma3_write,
        tiny={"head_dim": 24, "query_pre_attn_scalar": 32, "sliding_window": 8, "tie_word_embeddings": True,
              "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-6,
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
        activation_key="hidden_activation",
    ),
    # GPT-OSS's shapes, shrunk: heads 24 wide (gpt-oss: 64 heads of 64 over a width of 2,880), one sliding layer (window
    # 8, shorter than the tests' sequences) and one full, YaRN x4 over 64 positions unrounded (truncate false, as the
    # releases), 4 experts top-2, and the clamp at 0.1 (released: 7), which a tiny model's activations reach
    "gpt_oss": Family(
        "gpt_oss", "GptOssForCausalLM", read=family_fields.gpt_oss_read, write=family_fields.gpt_oss_write,
        tiny={"head_dim": 24, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
              "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "swiglu_limit": 0.1,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False}},
        activation_key="swiglu_limit",
    ),
    # Nemotron-H's shapes, shrunk: each kind of layer, Mamba-2 before attention and before an MLP, split 2 + 2 at PP=2;
    # 8 Mamba heads of 16 in 2 groups (8B: 128 heads of 64 in 8 groups) with a state of 16 (128), and chunks of 8
    # positions (128), shorter than the tests' sequences, so that the scan carries its state across chunks
    "nemotron_h": Family(
        "nemotron_h", "NemotronHForCausalLM", read=family_fields.nemotron_h_read, write=family_fields.nemotron_h_write,
        tiny={"num_hidden_layers": 4, "hybrid_override_pattern": "M*M-", "head_dim": 16, "mamba_num_heads": 8,
              "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "conv_kernel": 4,
              "layer_norm_epsilon": 1e-5},
        activation_key="mlp_hidden_act", not_keys=("rope_parameters", "rms_norm_eps")),
    # Qwen3-Next's shapes, shrunk: a gated DeltaNet layer and a gated attention layer, the first with experts and the
    # second a dense MLP (split 2 + 2 at PP=2); 2 key heads of 16 each serving 2 value heads of 24 (80B: 16 of 128
    # serving 32 of 128), attention heads 24 wide with a quarter rotating, 4 experts top-2 and a gated shared expert
    "qwen3_next": Family(
        "qwen3_next", "Qwen3NextForCausalLM", read=family_fields.qwen3_next_read, write=family_fields.qwen3_next_write,
        tiny={"layer_types": ["linear_attention", "full_attention"], "mlp_only_layers": [1], "head_dim": 24,
              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
}

# A tiny model of each family: 2 layers, width 64, GQA 4 heads over 2 KV heads, 256-token vocabulary
# (a multiple of 128 x TP for TP in {1, 2}, so vocabulary padding is the same at both).
TINY_HF = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


# Model types whose checkpoints are a family's architecture under a name of their own, their config.json pointing at
# remote code (`auto_map`) for a copy of that family's config class: read as the family, the remote code never run,
# where config.json names the family's architecture (Kimi-K2 is DeepSeek-V3's, 384 experts routed as in one group).
ALIASES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}


# Multimodal model types whose language model is a family's (`text_config`): its text part is converted, the vision
# tower and projector left in the source (Gemma 3 4B and up). The language model's tensors are stored under one of
# these prefixes in place of `model.` (the hub's, and transformers 5's in-memory names); the vision part under the others.
MULTIMODAL = {"gemma3": "gemma3_text"}
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _family_type(raw: dict[str, Any]) -> str | None:
    """The family a raw config.json's `model_type` is, through `ALIASES` where its architecture is the family's."""
    model_type = raw.get("model_type")
    alias = ALIASES.get(model_type)
    if alias is not None and raw.get("architectures") == [alias[1]]:
        return alias[0]
    return model_type


def native_config_json(path: Path) -> None:
    """Rewrite a copied config.json of an alias (`ALIASES`) as its family's, in place (model_type the family's, no
    auto_map), and a multimodal model's (`MULTIMODAL`) as its language model's: what a checkpoint keeps beside its
    tokenizer, so that transformers reads it without remote code, as the model the checkpoint holds."""
    if not path.is_file():
        return
    raw = _read_config_json(path)
    family = _family_type(raw)
    if family != raw.get("model_type") and family in FAMILIES:
        path.write_text(json.dumps({k: v for k, v in raw.items() if k != "auto_map"} | {"model_type": family},
                                   indent=2))
    elif raw.get("model_type") in MULTIMODAL:  # the language model's config, with the model's token ids
        text = MULTIMODAL[raw["model_type"]]
        ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
        path.write_text(json.dumps(raw.get("text_config", {}) | ids | {
            "model_type": text, "architectures": [FAMILIES[text].architecture]}, indent=2))


def supported() -> list[str]:
    return sorted(FAMILIES)


def family_of(hf: Any) -> Family:
    model_type = getattr(hf, "model_type", None)
    if model_type not in FAMILIES:
        archs = getattr(hf, "architectures", None)
        raise ConfigError(f"unsupported architecture: model_type={model_type!r} (architectures={archs}); "
                          f"the cookbook supports {supported()}.")
    return FAMILIES[model_type]


def load_hf_config(source: str | Path | dict[str, Any] | Any) -> Any:
    """A transformers config object from a model folder, a config.json path, a dict, or a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, dict):
        kwargs = {k: v for k, v in source.items() if k not in ("model_type", "auto_map")}
        if source.get("model_type") in MULTIMODAL:  # its text_config is read by from_hf
            return AutoConfig.for_model(source["model_type"], **kwargs)
        if _family_type(source) not in FAMILIES:
            raise ConfigError(f"unsupported architecture: model_type={source.get('model_type')!r}; "
                              f"the cookbook supports {supported()}.")
        return AutoConfig.for_model(_family_type(source), **kwargs)
    path = Path(source)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {folder}; point at a Hugging Face model folder "
                                f"(the one holding config.json and *.safetensors).")
    raw = _read_config_json(folder / "config.json")
    if _family_type(raw) != raw.get("model_type") and _family_type(raw) in FAMILIES:
        hf = load_hf_config(raw)  # an alias: the family's config class, not the checkpoint's remote code
        _check_keys(raw, hf, folder / "config.json")
        return hf
    if raw.get("model_type") not in FAMILIES and raw.get("model_type") not in MULTIMODAL:
        raise ConfigError(f"unsupported architecture: model_type={raw.get('model_type')!r} in {folder / 'config.json'}; "
                          f"the cookbook supports {supported()} (and the text model of {sorted(MULTIMODAL)}).")
    # trust_remote_code stays off: only architectures transformers itself implements are read.
    hf = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    _check_keys(raw, hf, folder / "config.json")
    return hf


# The keys that set the shapes of the weights: a misspelt one silently takes transformers' default.
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "num_local_experts", "num_experts", "moe_intermediate_size",
              "shared_expert_intermediate_size", "num_experts_per_tok", "tie_word_embeddings", "max_position_embeddings")


def _read_config_json(path: Path) -> dict[str, Any]:
    raw = inputs.read_json(path, fix="Download it again or restore it from the model's source.")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object of config keys; restore it.")
    return raw


def _check_keys(raw: dict[str, Any], hf: Any, path: Path) -> None:
    """Name a misspelt shape key (e.g. num_hidden_layer) instead of letting its default mismatch the weights."""
    import difflib

    known = set(type(hf)().to_dict()) | set(SHAPE_KEYS)
    for key in sorted(set(raw) - known):
        close = difflib.get_close_matches(key, [k for k in SHAPE_KEYS if k not in raw], n=1, cutoff=0.85)
        if close:
            raise ConfigError(f"{path} has the key {key!r}, which {type(hf).__name__} does not know; did you mean "
                              f"{close[0]!r}? Without it transformers uses its default ({getattr(hf, close[0], None)!r}), "
                              f"which does not match the weights. Fix the key in config.json.")


def from_hf(source: str | Path | dict[str, Any] | Any) -> ModelConfig:
    """ModelConfig of a Hugging Face model (folder, config.json, dict or transformers config).

    Raises:
        ConfigError: unknown architecture (lists the supported ones) or a feature Megatron-Core lacks.
    """
    hf = load_hf_config(source)
    if getattr(hf, "model_type", None) in MULTIMODAL:
        hf = hf.text_config  # the language model, converted alone
    family = family_of(hf)
    if family.activation_key == "hidden_act" and getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"{hf.model_type}: hidden_act={hf.hidden_act!r}; the cookbook maps SwiGLU (silu) MLPs.")
    fields = dict(
        family=family.name,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        vocab_size=hf.vocab_size,
        max_position_embeddings=hf.max_position_embeddings,
        norm_epsilon=getattr(hf, "rms_norm_eps", None),  # a hybrid's read gives its own
        normalization="RMSNorm",
        activation="swiglu",
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        init_method_std=getattr(hf, "initializer_range", 0.02),
    )
    fields |= family_fields.rotary(hf)
    fields |= family.read(hf)
    return ModelConfig(**fields)


def to_hf(model: ModelConfig, base: dict[str, Any] | None = None) -> Any:
    """The transformers config object for a ModelConfig (`.save_pretrained(folder)` writes config.json).

    Args:
        base: a source config.json's contents; its other fields (token ids, dtype, ...) are kept and
            the architecture fields are set from `model`.
    """
    from transformers import AutoConfig

    family = FAMILIES.get(model.family)
    if family is None:
        raise ConfigError(f"ModelConfig.family={model.family!r} is not a registered family; use one of "
                          f"{supported()}.")
    rope = {"rope_theta": model.rotary_base, "rope_type": "default"}
    if model.rotary_percent != 1.0:
        rope["partial_rotary_factor"] = model.rotary_percent
    if model.rope_scaling_factor is not None:
        rope |= {"rope_type": "llama3", "factor": model.rope_scaling_factor} | family_fields.MCORE_LLAMA3_ROPE
    if model.yarn is not None:  # truncate as transformers spells it
        rope |= {"rope_type": "yarn"} | model.yarn | ({"truncate": bool(model.yarn["truncate"])} if "truncate" in model.yarn
                                                      else {})
    kwargs = dict(
        architectures=[family.architecture],
        num_hidden_layers=model.num_layers,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.query_groups,
        head_dim=model.head_dim,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.init_method_std,
        rope_parameters=rope,
    )
    if family.activation_key == "hidden_act":
        kwargs["hidden_act"] = "silu"
    # the cookbook writes unquantized weights: a source's quantization_config (GPT-OSS's MXFP4) would misdescribe them
    # (and an alias's auto_map, the remote code of a config class the family's own replaces)
    kept = {k: family_fields.json_floats(v) for k, v in (base or {}).items()
            if k not in ("model_type", "transformers_version", "quantization_config", "auto_map")}
    kwargs = {k: v for k, v in kwargs.items() if k not in family.not_keys}
    return AutoConfig.for_model(family.name, **(kept | kwargs | family.write(model)))


def tiny_hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config of `family` (2 layers, width 64) for tests and CPU notebooks."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; the cookbook supports {supported()}.")
    from transformers import AutoConfig

    base = {k: v for k, v in TINY_HF.items() if k not in FAMILIES[family].not_keys}
    return AutoConfig.for_model(family, **(base | FAMILIES[family].tiny | overrides))


def tiny(family: str = "llama", **overrides: Any) -> ModelConfig:
    """ModelConfig of the tiny model of `family`; `overrides` change ModelConfig fields."""
    return dataclasses.replace(from_hf(tiny_hf_config(family)), **overrides)
