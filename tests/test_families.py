"""Model-family registry: Hugging Face config <-> ModelConfig, and the Megatron-Core model it builds."""

import dataclasses
import json

import pytest
import transformers

from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.config import ConfigError
from tests.conftest import tiny_run

# Fields of the HF config that decide the function the model computes.
HF_KEYS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
           "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
           "shared_expert_intermediate_size", "norm_topk_prob", "sliding_window"]


@pytest.mark.parametrize("family", families.supported())
def test_hf_config_round_trip(family):
    hf = families.tiny_hf_config(family)
    model = families.from_hf(hf)
    back = families.to_hf(model)
    assert families.from_hf(back) == model
    for key in HF_KEYS:
        if hasattr(hf, key):
            assert getattr(back, key) == getattr(hf, key), key
    assert back.architectures == [families.FAMILIES[family].architecture]


@pytest.mark.parametrize("family", families.supported())
def test_written_config_loads_in_transformers(family, tmp_path):
    families.to_hf(families.tiny(family)).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert type(model).__name__ == families.FAMILIES[family].architecture


def test_reads_a_legacy_llama3_config_json(tmp_path):
    # The shape of a real Llama 3.1 download: rope_theta and rope_scaling at the top level.
    legacy = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    model = families.from_hf(tmp_path)
    assert model.rotary_base == 500000.0 and model.rope_scaling_factor == 8.0 and model.query_groups == 2


def test_qwen2_moe_sparse_step_maps_to_a_layer_pattern():
    hf = families.tiny_hf_config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2)
    model = families.from_hf(hf)
    assert model.moe_layer_freq == [0, 1, 0, 1]  # HF: MoE where (i + 1) % step == 0
    assert model.moe_shared_expert_gate and model.moe_router_pre_softmax  # norm_topk_prob=False
    back = families.to_hf(model)
    assert back.mlp_only_layers == [0, 2] and families.from_hf(back) == model


@pytest.mark.parametrize("bad, message", [
    ({"model_type": "gpt2"},
     r"unsupported architecture: model_type='gpt2'.*supports \['deepseek_v3', 'gemma3_text', 'glm4_moe', 'gpt_oss', 'llama'"),
])
def test_unknown_architecture_lists_supported(bad, message):
    with pytest.raises(ConfigError, match=message):
        families.from_hf(bad)


@pytest.mark.parametrize("overrides, message", [
    ({"final_logit_softcapping": 30.0}, r"gemma3_text with \{'final_logit_softcapping': 30.0\}"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, r"hidden_activation='silu'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}},
     r"default or linear on full ones"),
])
def test_a_gemma3_the_cookbook_cannot_reproduce_is_refused(overrides, message):
    """Gemma 3's variants whose outputs the cookbook would not reproduce: refused by name, not converted wrong."""
    bad = families.tiny_hf_config("gemma3_text", **overrides)
    with pytest.raises(ConfigError, match=message):
        families.from_hf(bad)


@pytest.mark.parametrize("overrides, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_type='dynamic' is not supported"),
    ({"attention_bias": True}, r"attention_bias/mlp_bias=True .* is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 2.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     r"differs from Megatron-Core's built-in"),
])
def test_features_megatron_lacks_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        families.from_hf(families.tiny_hf_config("llama", **overrides))


@pytest.mark.parametrize("family, overrides, message", [
    ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave=False; Megatron-Core's multi-latent attention"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "truncate": False,
                                         "original_max_position_embeddings": 64}},
     r"yarn rotary scaling with \{'truncate': False\} has no Megatron-Core equivalent"),
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, r"rms_norm_eps=1e-05; transformers builds the latent norms with 1e-06"),
    ("deepseek_v3", {"num_experts_per_tok": 2}, r"num_experts_per_tok=2 and topk_group=2; .* best 2 experts"),
    ("deepseek_v3", {"norm_topk_prob": False}, r"norm_topk_prob=False; Megatron-Core's sigmoid router always"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"quantized \(fp8, .*Dequantize it to bf16 first"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.2,
                                         "original_max_position_embeddings": 64}},
     r"yarn rotary scaling with \{'attention_factor': 1.2\} has no Megatron-Core equivalent"),
    ("glm4_moe", {"norm_topk_prob": False}, r"glm4_moe: norm_topk_prob=False"),
    ("gpt_oss", {"swiglu_alpha": 1.5}, r"gpt_oss: swiglu_alpha=1.5; Megatron-Core's quick GELU has 1.702 built in"),
    ("gpt_oss", {"attention_bias": False}, r"gpt_oss: attention_bias=False; Megatron-Core gives the router"),
    ("gpt_oss", {"quantization_config": {"quant_method": "fp8"}}, r"gpt_oss: quantization_config quant_method='fp8'"),
    ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, r"gpt_oss: layer types \['chunked_attention'\]"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "attention_factor": 1.2,
                                   "original_max_position_embeddings": 64}},
     r"qwen3: yarn rotary scaling with \{'attention_factor': 1.2\} has no Megatron-Core equivalent"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                      "partial_rotary_factor": 0.5, "original_max_position_embeddings": 64}},
     r"glm4_moe: yarn rotary scaling of part of each head \(partial_rotary_factor 0.5\) is not reproduced yet"),
])
def test_what_the_2026_families_do_that_megatron_core_cannot_is_refused(family, overrides, message):
    with pytest.raises(ConfigError, match=message):
        families.from_hf(families.tiny_hf_config(family, **overrides))


def test_deepseek_v3_reads_as_released(tmp_path):
    """DeepSeek-V3's config.json as published (legacy rope_scaling, 61 layers of which 3 dense, 256 experts in 8
    groups): YaRN x40 over 4,096 positions with its attention scale, no rotary aliasing refused at 163,840."""
    released = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
                "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
                "rms_norm_eps": 1e-6, "rope_theta": 10000, "vocab_size": 129280, "hidden_act": "silu",
                "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096, "type": "yarn"}}
    (tmp_path / "config.json").write_text(json.dumps(released))
    model = families.from_hf(tmp_path)
    assert model.multi_latent_attention and model.kv_channels == 192 and model.v_head_dim == 128
    assert model.yarn == {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                          "mscale": 1.0, "mscale_all_dim": 1.0}
    assert model.moe_layer_freq == [0] * 3 + [1] * 58 and model.moe_shared_expert_intermediate_size == 2048
    assert (model.moe_router_num_groups, model.moe_router_group_topk, model.moe_router_topk_scaling_factor) == (8, 4, 2.5)


def _read_as_the_planners_shape(released: dict, name: str, tmp_path) -> dict:
    """The fields in which the model read from a published config.json differs from the planner's shape `name` (the
    init std aside: a training setting)."""
    from pai_cookbook.plan.shapes import SHAPES

    (tmp_path / "config.json").write_text(json.dumps(released))
    model, shape = families.from_hf(tmp_path), SHAPES[name]
    return {f.name: (getattr(model, f.name), getattr(shape, f.name)) for f in dataclasses.fields(model)
            if getattr(model, f.name) != getattr(shape, f.name) and f.name != "init_method_std"}


def test_gpt_oss_reads_as_released(tmp_path):
    """gpt-oss-20b's config.json as published (legacy rope_scaling with truncate false, the legacy experts_per_token,
    MXFP4's quantization_config, a hidden_act it does not use): the planner's shape of it, field for field."""
    released = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
                "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
                "vocab_size": 201088, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
                "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 4096},
                "initial_context_length": 4096, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False, "hidden_act": "silu",
                "router_aux_loss_coef": 0.9, "pad_token_id": 199999, "eos_token_id": 200002,
                "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    assert _read_as_the_planners_shape(released, "gpt-oss-20b", tmp_path) == {}


def test_gemma_3_27b_reads_as_released(tmp_path):
    """Gemma 3 27B's config.json as published (the multimodal `gemma3`: a text_config of the fields that differ from
    transformers' defaults, a SigLIP vision_config): its language model is the planner's shape of it, field for field."""
    released = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                "eoi_token_index": 256000, "image_token_index": 262144, "eos_token_id": [1, 106],
                "mm_tokens_per_image": 256, "initializer_range": 0.02,
                "text_config": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
                                "intermediate_size": 21504, "num_attention_heads": 32, "num_hidden_layers": 62,
                                "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                                  "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                                  "patch_size": 14, "vision_use_head": False}}
    assert _read_as_the_planners_shape(released, "Gemma-3-27B", tmp_path) == {}


def test_missing_config_json_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        families.from_hf(tmp_path)


@pytest.mark.parametrize("family", families.supported())
def test_megatron_model_has_the_hf_parameter_count(family, run_scenario):
    # Same architecture => same number of parameters (vocab 256 needs no padding at TP=1).
    hf_params = transformers.AutoModelForCausalLM.from_config(families.tiny_hf_config(family)).num_parameters()
    result = run_scenario(tiny_run(family), 1, "param_counts")
    assert result["padded_vocab_size"] == 256
    assert result["params"] == hf_params


@pytest.mark.both_ends
@pytest.mark.parametrize("family, release, refused, purpose, uneven, named", [
    # no local multi-latent attention without Transformer Engine on 0.16; a TP that splits the latents unevenly
    ("deepseek_v3", (0, 17), r"multi-latent attention \(deepseek_v3\) on Megatron-Core 0\.1\d.*from 0\.17", "load",
     {"kv_lora_rank": 31}, r"kv_lora_rank \+ qk_pos_emb_head_dim = 47 is not divisible by TP=2"),
    # no HybridModel before 0.19; a TP that splits a Mamba-2 group
    ("nemotron_h", (0, 19), r"nemotron_h is a hybrid model .* from 0\.19 on", "train", {"mamba_num_groups": 1},
     r"TP=2 must divide the Mamba-2 layers' 8 heads and 1 groups .* Use TP in \[1\]"),
    # likewise; a TP that splits a gated DeltaNet's key heads
    ("qwen3_next", (0, 19), r"qwen3_next is a hybrid model .* from 0\.19 on", "load",
     {"gdn_key_heads": 1, "gdn_value_heads": 2}, r"TP=2 must divide the gated DeltaNet layers' 1 key heads .* \[1\]"),
])
def test_families_a_release_first_builds_are_refused_before_it(family, release, refused, purpose, uneven, named):
    """Refused before launch on a Megatron-Core older than the release that builds the family, naming that release;
    from it on accepted at TP=2, and a TP the model's shape does not divide named."""
    from pai_cookbook.core.configs import layout
    from pai_cookbook.core.configs.config import ParallelConfig
    from pai_cookbook.core.machine import versions

    if versions.minor() < release:
        with pytest.raises(ConfigError, match=refused):
            layout.check(families.tiny(family), ParallelConfig(), purpose="load")
        return
    layout.check(families.tiny(family), ParallelConfig(tensor_model_parallel_size=2), purpose=purpose)
    with pytest.raises(ConfigError, match=named):
        layout.check(families.tiny(family, **uneven), ParallelConfig(tensor_model_parallel_size=2), purpose="load")


def test_lora_on_a_hybrid_model_is_refused_by_name():
    from pai_cookbook.core.configs.lora import LoRAConfig

    for family in ("nemotron_h", "qwen3_next"):
        with pytest.raises(ConfigError, match=rf"LoRA on a hybrid model \({family}: Mamba-2 or gated DeltaNet layers\)"):
            LoRAConfig().check(families.tiny(family))
