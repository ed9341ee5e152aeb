"""Models a plan is made for: a few named shapes (from their published config.json), or any Hugging Face folder the
cookbook's families read (`core.checkpoints.families.from_hf`)."""

from __future__ import annotations

from pathlib import Path

from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.model_config import ConfigError, ModelConfig

_LLAMA3_ROPE = dict(rotary_base=500000.0)
_QWEN3 = dict(family="qwen3", kv_channels=128, vocab_size=151936, max_position_embeddings=40960, rotary_base=1000000.0,
              norm_epsilon=1e-6, qk_layernorm=True)
_QWEN3_MOE = _QWEN3 | dict(family="qwen3_moe", num_experts=128, moe_router_topk=8, moe_aux_loss_coeff=0.001)
_GPT_OSS = dict(family="gpt_oss", hidden_size=2880, ffn_hidden_size=2880, num_attention_heads=64, num_query_groups=8,
                kv_channels=64, vocab_size=201088, max_position_embeddings=131072, rotary_base=150000.0,
                yarn={"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 0.0, "truncate": 0},
                activation="quick_geglu", glu_clamp=7.0, glu_linear_offset=1.0, attention_sinks=True,
                add_bias_linear=True, sliding_window=128, moe_router_topk=4, moe_ffn_hidden_size=2880,
                moe_router_load_balancing_type="none")

_NEMOTRON_H = dict(family="nemotron_h", num_query_groups=8, kv_channels=128, vocab_size=131072,
                   max_position_embeddings=8192, position_embedding_type="none", activation="squared_relu",
                   mamba_head_dim=64, mamba_num_groups=8, mamba_conv_kernel=4, mamba_chunk_size=128)
# Mamba-2 ("M"), attention ("*") and MLP ("-") layers, in the order the releases' config.json lists them
_NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_NEMOTRON_H_56B = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
                   "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")

# Qwen3-Next-80B-A3B: 48 layers, each gated DeltaNet ("G") or, every fourth, gated attention ("*"), then 512 experts
_QWEN3_NEXT_80B = "GEGEGE*E" * 12

SHAPES: dict[str, ModelConfig] = {
    "Llama-2-7B": ModelConfig(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                              num_attention_heads=32, num_query_groups=32, vocab_size=32000,
                              max_position_embeddings=4096, norm_epsilon=1e-5),
    "Llama-3-8B": ModelConfig(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                              num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                              max_position_embeddings=8192, **_LLAMA3_ROPE),
    "Llama-3.1-8B": ModelConfig(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                                num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                                max_position_embeddings=131072, rope_scaling_factor=8.0, **_LLAMA3_ROPE),
    "Llama-3-70B": ModelConfig(family="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                               num_attention_heads=64, num_query_groups=8, vocab_size=128256,
                               max_position_embeddings=8192, **_LLAMA3_ROPE),
    "Llama-3.2-1B": ModelConfig(family="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                                num_attention_heads=32, num_query_groups=8, kv_channels=64, vocab_size=128256,
                                max_position_embeddings=131072, tie_word_embeddings=True, rope_scaling_factor=32.0,
                                **_LLAMA3_ROPE),
    "Llama-3.2-3B": ModelConfig(family="llama", num_layers=28, hidden_size=3072, ffn_hidden_size=8192,
                                num_attention_heads=24, num_query_groups=8, kv_channels=128, vocab_size=128256,
                                max_position_embeddings=131072, tie_word_embeddings=True, rope_scaling_factor=32.0,
                                **_LLAMA3_ROPE),
    "Qwen3-8B": ModelConfig(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                            num_query_groups=8, **_QWEN3),
    "Qwen3-32B": ModelConfig(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                             num_query_groups=8, **_QWEN3),
    "Qwen3-30B-A3B": ModelConfig(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                                 num_query_groups=4, moe_ffn_hidden_size=768, **_QWEN3_MOE),
    "Qwen3-235B-A22B": ModelConfig(num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
                                   num_query_groups=4, moe_ffn_hidden_size=1536, **_QWEN3_MOE),
    # without its multi-token-prediction layer (14B more), which the cookbook does not convert
    "DeepSeek-V3": ModelConfig(family="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
                               num_attention_heads=128, num_query_groups=128, kv_channels=192, vocab_size=129280,
                               max_position_embeddings=163840, norm_epsilon=1e-6, qk_layernorm=True,
                               multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                               qk_pos_emb_head_dim=64, v_head_dim=128,
                               yarn={"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                               num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                               moe_shared_expert_intermediate_size=2048, moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True, moe_router_num_groups=8, moe_router_group_topk=4,
                               moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0] * 3 + [1] * 58),
    "Qwen2.5-7B": ModelConfig(family="qwen2", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                              num_attention_heads=28, num_query_groups=4, vocab_size=152064, add_qkv_bias=True,
                              max_position_embeddings=32768, rotary_base=1000000.0, norm_epsilon=1e-6),
    "Mixtral-8x7B": ModelConfig(family="mixtral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                                num_attention_heads=32, num_query_groups=8, vocab_size=32000,
                                max_position_embeddings=32768, rotary_base=1000000.0, num_experts=8,
                                moe_router_topk=2, moe_ffn_hidden_size=14336, moe_aux_loss_coeff=0.02),
    # the language model of Gemma 3 27B (its vision tower, 0.4B, is not trained here)
    "Gemma-3-27B": ModelConfig(family="gemma3_text", num_layers=62, hidden_size=5376, ffn_hidden_size=21504,
                               num_attention_heads=32, num_query_groups=16, kv_channels=128, vocab_size=262208,
                               max_position_embeddings=131072, rotary_base=1e6, local_rotary_base=1e4,
                               rotary_linear_factor=8.0, sliding_window=1024,
                               sliding_window_layers=[int((i + 1) % 6 != 0) for i in range(62)],
                               query_pre_attn_scalar=168, norm_epsilon=1e-6, activation="geglu", qk_layernorm=True,
                               norm_plus_one=True, post_norms=True, embedding_multiplier=5376 ** 0.5,
                               tie_word_embeddings=True),
    "gpt-oss-20b": ModelConfig(num_layers=24, sliding_window_layers=[1, 0] * 12, num_experts=32, **_GPT_OSS),
    "gpt-oss-120b": ModelConfig(num_layers=36, sliding_window_layers=[1, 0] * 18, num_experts=128, **_GPT_OSS),
    "Qwen3-Next-80B-A3B": ModelConfig(
        family="qwen3_next", hybrid_pattern=_QWEN3_NEXT_80B, num_layers=96, hidden_size=2048, ffn_hidden_size=5120,
        num_attention_heads=16, num_query_groups=2, kv_channels=256, vocab_size=151936, max_position_embeddings=262144,
        rotary_base=1e7, rotary_percent=0.25, norm_epsilon=1e-6, norm_plus_one=True, qk_layernorm=True,
        attention_output_gate=True, gdn_key_heads=16, gdn_value_heads=32, gdn_key_head_dim=128, gdn_value_head_dim=128,
        num_experts=512, moe_router_topk=10, moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=512,
        moe_shared_expert_gate=True, moe_aux_loss_coeff=0.001),
    "Nemotron-H-8B": ModelConfig(hybrid_pattern=_NEMOTRON_H_8B, num_layers=52, hidden_size=4096, ffn_hidden_size=21504,
                                 num_attention_heads=32, mamba_num_heads=128, mamba_state_dim=128, **_NEMOTRON_H),
    "Nemotron-H-56B": ModelConfig(hybrid_pattern=_NEMOTRON_H_56B, num_layers=118, hidden_size=8192,
                                  ffn_hidden_size=32768, num_attention_heads=64, mamba_num_heads=256, mamba_state_dim=256,
                                  **_NEMOTRON_H),
}
"""Architectures as their Hugging Face config.json publishes them (Megatron-Core's names)."""


def model_shape(name_or_path: str | Path) -> ModelConfig:
    """A named shape of `SHAPES` (case-insensitive), or the model of a Hugging Face folder / config.json.

    Raises:
        ConfigError: neither a known name nor a readable Hugging Face config (lists the names).
    """
    for key, value in SHAPES.items():
        if key.lower() == str(name_or_path).lower():
            return value
    if Path(name_or_path).exists():
        return families.from_hf(name_or_path)
    raise ConfigError(f"unknown model {name_or_path!r}: name one of {sorted(SHAPES)} or give a Hugging Face folder "
                      f"(or its config.json).")
