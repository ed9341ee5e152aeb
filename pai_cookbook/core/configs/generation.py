"""How to decode: `GenerationConfig`, the knobs of generation (Megatron-Core's static inference engine), checked when
built. The generation recipe (`pai_cookbook.generate`) and RL's rollouts hand it to the engine (`workers.engine`)."""

from __future__ import annotations

from dataclasses import dataclass

from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.launching import inputs

CHAT_TEMPLATE_MODES = ("auto", "always", "never")
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True)
class GenerationConfig:
    """How to decode. Defaults: greedy, 64 new tokens, repetition penalty 1.2 (the seed script's)."""

    max_new_tokens: int = 64
    """Tokens to generate per prompt at most (the seed script's output sequence length)."""
    top_k: int = 1
    """Sample among the k most likely tokens; 1 is greedy decoding, 0 switches top-k off."""
    top_p: float = 0.0
    """Nucleus sampling: the smallest set of tokens with this much probability; 0.0 switches it off."""
    temperature: float = 1.0
    """Logits are divided by it before top-k/top-p sampling (no effect on greedy decoding)."""
    repetition_penalty: float = 1.2
    """Hugging Face's rule on every token already in the prompt or completion: a positive logit is
    divided by it, a negative one multiplied; 1.0 switches it off."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion (cut from the text, finish_reason "stop")."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids beyond the checkpoint's own (e.g. a chat model's end-of-turn token)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks and parity checks of fixed length)."""
    seed: int = 1234
    """Sampling seed; outputs depend on it and on batch_size, not on TP, PP or the number of processes."""
    batch_size: int = 8
    """Prompts decoded together (the KV cache holds batch_size x sequence tokens per layer)."""
    max_sequence_length: int | None = None
    """Context (prompt + new tokens) the KV cache is sized for; None: the model's own limit."""
    chat_template: str = "auto"
    """Format prompts with the tokenizer's chat template: "auto" (when it has one), "always", "never"."""
    dtype: str | None = None
    """Compute dtype fp32/bf16/fp16; None: the checkpoint's own."""
    kv_cache: bool = True
    """Reuse keys/values of earlier tokens (one-token steps); False recomputes the prefix every step."""

    def __post_init__(self) -> None:
        self.stop, self.eos_token_ids = tuple(self.stop), tuple(self.eos_token_ids)
        for name in ("max_new_tokens", "batch_size"):
            inputs.integer(getattr(self, name), name)
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (1 is greedy, 0 switches top-k off).")
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in [0, 1] (0.0 switches nucleus sampling off).")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ConfigError(f"top_k={self.top_k} and top_p={self.top_p} are both set; Megatron-Core samples with "
                              f"one of them: set top_k=0 to sample with top_p, or top_p=0.0 to keep top-k "
                              f"(top_k=1 is greedy).")
        if not self.temperature > 0.0:
            raise ConfigError(f"temperature={self.temperature} must be > 0; for deterministic output use top_k=1.")
        if not self.repetition_penalty > 0.0:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 switches it off).")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ConfigError(f"chat_template={self.chat_template!r}; use one of {CHAT_TEMPLATE_MODES}.")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES} or None (the checkpoint's dtype).")
        if any(not s for s in self.stop):
            raise ConfigError(f"stop={self.stop} holds an empty string, which would stop at once; remove it.")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def kv_cache_bytes(model, batch: int, max_sequence: int, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
    """What Megatron-Core's static engine allocates for the KV cache on one rank: for each of the rank's layers a key
    and a value buffer of [max_sequence, batch, query groups / TP, head width] (`Attention._allocate_memory`). Multi-
    latent attention caches keys and values after their up-projection, per head: keys of the head's width plus the
    shared rotary part, values of `v_head_dim`. Per token of context per sequence it is this over batch x max_sequence.
    A hybrid's Mamba-2 and gated DeltaNet layers hold a state per sequence instead, whatever its length
    (`_recurrent_state_bytes`), and its MLP and expert layers nothing."""
    if model.is_hybrid:
        per_stage = model.num_layers // pp
        stages = [model.hybrid_pattern[s * per_stage:(s + 1) * per_stage] for s in range(pp)]
        attention = model.query_groups // tp * 2 * model.head_dim * max_sequence * batch * dtype_bytes
        return max(sum(attention if kind == "*" else _recurrent_state_bytes(model, kind, batch, dtype_bytes, tp)
                       for kind in stage) for stage in stages)
    if model.multi_latent_attention:
        groups, key, value = model.num_attention_heads, model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim
    else:
        groups, key, value = model.query_groups, model.head_dim, model.head_dim
    layers = -(-model.num_layers // pp)  # the most loaded pipeline stage
    return layers * max_sequence * batch * (groups // tp) * (key + value) * dtype_bytes


def _recurrent_state_bytes(model, kind: str, batch: int, dtype_bytes: int, tp: int) -> int:
    """A recurrent layer's generation state per batch: a Mamba-2 layer's last convolution inputs [b, channels, kernel]
    and its state [b, heads, head_dim, state] (Megatron-Core's, both in the model's dtype); a gated DeltaNet's last
    convolution inputs [b, channels, kernel - 1] in the model's dtype and its state [b, value heads, key width, value
    width] in fp32 (`core.modeling.delta_net`)."""
    if kind == "M":
        channels = model.mamba_conv_channels // tp
        state = model.mamba_num_heads // tp * model.mamba_head_dim * model.mamba_state_dim
        return batch * (channels * model.mamba_conv_kernel + state) * dtype_bytes
    if kind == "G":
        channels = 2 * model.gdn_key_dim + model.gdn_value_dim
        state = model.gdn_value_heads // tp * model.gdn_key_head_dim * model.gdn_value_head_dim
        return batch * (channels // tp * (model.gdn_conv_kernel - 1) * dtype_bytes + state * 4)
    return 0
