"""Models a plan is made for: a few named shapes (from their published config.json), or any Hugging Face folder the
cookbook's families read (`core.families.from_hf`)."""

from __future__ import annotations

from pathlib import Path

from pai_cookbook.core import families
from pai_cookbook.core.model_config import ConfigError, ModelConfig

_LLAMA3_ROPE = dict(rotary_base=500000.0)

SHAPES: dict[str, ModelConfig] = {
    "Llama-2-7B": ModelConfig(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                              num_attention_heads=32, num_query_groups=32, vocab_size=32000,
                              max_position_embeddings=4096, norm_epsilon=1e-5),
    "Llama-3-8B": ModelConfig(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                              num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                              max_position_embeddings=8192, **_LLAMA3_ROPE),
    "Llama-3.2-1B": ModelConfig(family="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                                num_attention_heads=32, num_query_groups=8, kv_channels=64, vocab_size=128256,
                                max_position_embeddings=131072, tie_word_embeddings=True, rope_scaling_factor=32.0,
                                **_LLAMA3_ROPE),
    "Qwen2.5-7B": ModelConfig(family="qwen2", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
                              num_attention_heads=28, num_query_groups=4, vocab_size=152064, add_qkv_bias=True,
                              max_position_embeddings=32768, rotary_base=1000000.0, norm_epsilon=1e-6),
    "Mixtral-8x7B": ModelConfig(family="mixtral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                                num_attention_heads=32, num_query_groups=8, vocab_size=32000,
                                max_position_embeddings=32768, rotary_base=1000000.0, num_experts=8,
                                moe_router_topk=2, moe_ffn_hidden_size=14336, moe_aux_loss_coeff=0.02),
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
