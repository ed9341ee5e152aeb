"""The model's architecture as one validated dataclass, and the error every cookbook config raises.

`ModelConfig` describes a decoder-only transformer in Megatron-Core's vocabulary (dense or MoE);
`core.checkpoints.families` fills it from a Hugging Face `config.json`, `core.modeling.model` turns it into
a Megatron-Core `TransformerConfig`. The run-side concerns (layout, precision, optimizer, data,
checkpoints) are in `core.configs.config`, which re-exports both names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the value and the fix."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value > 0, f"{type(obj).__name__}.{name} must be > 0, got {value}.")


HYBRID_LAYERS = ("M", "G", "*", "-", "E")
"""The layers a hybrid pattern may hold: Mamba-2, gated DeltaNet, attention, MLP, mixture of experts (Megatron-Core's
`hybrid_layer_allocation.Symbols`)."""


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, in Megatron-Core's vocabulary.

    `core.checkpoints.families` fills this from a Hugging Face `config.json`; the defaults describe a
    Llama-style model (RMSNorm, SwiGLU, rotary, no biases, untied embeddings).
    """

    family: str = "llama"
    """Registry name of the model family (see `core.checkpoints.families.FAMILIES`)."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """Width of the dense MLP (per branch of SwiGLU)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means multi-head attention (= heads)."""
    kv_channels: int | None = None
    """Head dimension; None means hidden_size / num_attention_heads."""
    vocab_size: int
    """Tokenizer vocabulary size, before Megatron's padding (see `padded_vocab_size`)."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this x TP, so every TP shard is GEMM-friendly."""
    max_position_embeddings: int
    """Longest sequence the position encoding is configured for."""
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"
    """Rotary (Llama, Qwen, Mistral) or learned absolute positions (GPT-2)."""
    rotary_base: float = 10000.0
    """Rotary base theta (Llama 2: 1e4, Llama 3: 5e5, Qwen2: 1e6)."""
    rotary_percent: float = 1.0
    """Fraction of the head dimension that rotates."""
    rope_scaling_factor: float | None = None
    """Llama 3.1-style rotary frequency scaling factor; None disables it."""
    sliding_window: int | None = None
    """Mistral's attention window W (Hugging Face's `sliding_window`): every layer's query sees itself and the W - 1
    positions before it (Megatron-Core's `window_size` (W - 1, 0)); None: full attention."""
    sliding_window_layers: list[int] | None = None
    """0/1 per layer: which layers take the sliding window (Gemma 3: five of every six); None: all of them."""
    local_rotary_base: float | None = None
    """Rotary base of the sliding-window layers (Gemma 3's local base, 1e4); None: rotary_base on every layer."""
    rotary_linear_factor: float | None = None
    """Linear rotary scaling (frequencies divided by it; Gemma 3 4B and up: 8): of the full-attention layers where
    local_rotary_base gives the sliding-window layers their own, else of every layer."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by its -1/2 power (Gemma 3) instead of the head width's; None: the head width."""
    norm_plus_one: bool = False
    """RMSNorm scales by (1 + weight), in fp32, its weight starting at zero (Gemma)."""
    post_norms: bool = False
    """A norm on the attention's output and on the MLP's, before each residual add (Gemma 2 and 3)."""
    embedding_multiplier: float | None = None
    """Token embeddings are multiplied by it, rounded to the parameters' dtype first (Gemma: sqrt(hidden_size))."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_epsilon: float = 1e-5
    activation: Literal["swiglu", "gelu", "geglu", "quick_geglu", "squared_relu"] = "swiglu"
    """MLP activation; swiglu means gated SiLU with gate and up projections, geglu gated GELU with tanh's
    approximation (Gemma's gelu_pytorch_tanh), quick_geglu the gate through x * sigmoid(1.702 x) (GPT-OSS's)."""
    glu_clamp: float | None = None
    """Gated MLPs: the gate half clamped from above and the linear half to [-glu_clamp, glu_clamp], after the bias and
    before the product (GPT-OSS's swiglu_limit, 7); None: unclamped."""
    glu_linear_offset: float = 0.0
    """Added to a gated MLP's linear half before the product (GPT-OSS: 1)."""
    attention_sinks: bool = False
    """A learned logit per query head that every row of attention scores takes beside its keys: it takes probability
    from the keys and gives no value back, so a head may attend to nothing (GPT-OSS's sinks; Megatron-Core's
    softmax_type 'learnable')."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2)."""
    add_bias_linear: bool = False
    """Bias on every linear layer (GPT-2 style)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (Qwen3); with multi-latent attention, the two latents (DeepSeek-V3)."""
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3, Kimi K2): keys and values rebuilt per head from one small latent per
    token, queries from another (or straight from the hidden state), each query/key head a part without rotary and a
    rotary part (the key's shared by every head). The fields below shape it; kv_channels is the query/key head width
    (qk_head_dim + qk_pos_emb_head_dim) and num_query_groups is unused."""
    q_lora_rank: int | None = None
    """Width of the query latent; None projects queries straight from the hidden state (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Width of the key/value latent."""
    qk_head_dim: int = 128
    """Width of each query/key head's part without rotary."""
    qk_pos_emb_head_dim: int = 64
    """Width of each query/key head's rotary part."""
    v_head_dim: int = 128
    """Width of each value head."""
    yarn: dict[str, float] | None = None
    """YaRN rotary scaling (DeepSeek-V3's and GPT-OSS's 128k context) in Megatron-Core's terms: factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, and without multi-latent attention
    `truncate` (1: the correction range rounded to whole dimensions, transformers' default; 0: not, GPT-OSS's); None:
    plain rotary. Multi-latent attention builds its own; other attention takes GPTModel's YaRN rotary."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer (small Qwen2 models)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_backend: Literal["sdpa", "unfused"] = "sdpa"
    """Core attention where Transformer Engine's is not used (every CPU run): "sdpa", PyTorch's fused
    scaled_dot_product_attention (`core.modeling.attention`); "unfused", Megatron-Core's DotProductAttention, whose
    score matrix is materialised. Same parameters and results (to float rounding); not architecture."""
    init_method_std: float = 0.02
    """Std of the normal weight init for models trained from scratch."""

    num_experts: int | None = None
    """Routed experts per MoE layer; None means a dense model."""
    moe_router_topk: int = 2
    """Experts each token is sent to."""
    moe_ffn_hidden_size: int | None = None
    """Width of one routed expert; None means ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the always-on shared expert (Qwen2-MoE); None means no shared expert."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert by a learned sigmoid gate (Qwen2-MoE)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k, without renormalising (Qwen2-MoE norm_topk_prob=False)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, added to sigmoid scores for the top-k
    choice only, moves each step towards equal load (needs moe_router_score_function='sigmoid')."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of that bias per optimizer step."""
    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V3: 256 experts in 8 groups): experts are split into this many groups and a
    token picks its top-k only among the `moe_router_group_topk` groups whose two best scores sum highest."""
    moe_router_group_topk: int | None = None
    """Groups a token may route to (DeepSeek-V3: 4 of 8); with moe_router_num_groups."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the routed experts' weights (DeepSeek-V3's routed_scaling_factor 2.5); None: 1."""
    moe_layer_freq: int | list[int] = 1
    """Every n-th layer is MoE (1: all, 2: every other layer as GShard did), or a 0/1 flag per layer."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                            "none"] = "aux_loss"
    """Aux loss over the micro-batch, per sequence, or over the global batch; Sinkhorn (top-1) balances
    by assignment instead of by a loss."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight (Mixtral: 0.02); 0 trains without it."""
    moe_z_loss_coeff: float | None = None
    """Router z-loss weight (ST-MoE: 1e-3); None disables it."""
    moe_expert_capacity_factor: float | None = None
    """Tokens an expert takes per micro-batch, as a multiple of its fair share (tokens x top-k / experts);
    tokens beyond it are dropped (lowest router probability first). None: dropless."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (static shapes); needs moe_expert_capacity_factor."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """How tokens reach experts across EP ranks; flex needs DeepEP (GPU only)."""
    moe_grouped_gemm: bool | None = None
    """Grouped GEMM for experts; None picks it on GPU and a per-expert loop on CPU."""

    # Hybrid models (Nemotron-H): Megatron-Core's HybridModel, one layer per symbol of the pattern
    hybrid_pattern: str | None = None
    """One symbol per layer: "M" a Mamba-2 layer, "*" an attention layer, "-" an MLP layer (each with its own pre-norm
    and residual); None for a transformer (attention and MLP in every layer)."""
    mamba_num_heads: int | None = None
    mamba_head_dim: int = 64
    mamba_state_dim: int = 128
    mamba_num_groups: int = 8
    """Groups of heads sharing one B and C projection (Mamba-2's `n_groups`)."""
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 128
    """Positions per chunk of the state-space scan: how the sum is split, not what it is."""
    gdn_key_heads: int | None = None
    """Gated DeltaNet layers ("G", Qwen3-Next's linear attention): key heads (each shared by value heads / key heads
    value heads), their widths, and the causal convolution's kernel."""
    gdn_value_heads: int | None = None
    gdn_key_head_dim: int = 128
    gdn_value_head_dim: int = 128
    gdn_conv_kernel: int = 4
    attention_output_gate: bool = False
    """Attention output times sigmoid of a per-head gate projected with the queries (Qwen3-Next's full attention)."""

    def __post_init__(self) -> None:
        positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "vocab_size", "max_position_embeddings",
                  "rotary_base", "num_experts", "moe_router_topk", "sliding_window")
        require(isinstance(self.moe_layer_freq, list) or (isinstance(self.moe_layer_freq, int)
                                                          and self.moe_layer_freq >= 1),
                 f"moe_layer_freq={self.moe_layer_freq!r} must be an int >= 1 (every n-th layer is MoE) or a list of "
                 f"one 0/1 flag per layer.")
        layers = self.sliding_window_layers
        require(layers is None or (self.sliding_window is not None and len(layers) == self.num_layers
                                   and set(layers) <= {0, 1}),
                 f"sliding_window_layers needs sliding_window and one 0/1 flag per layer ({self.num_layers}), got "
                 f"{layers} with sliding_window {self.sliding_window}.")
        require(self.local_rotary_base is None or layers is not None,
                 "local_rotary_base is the sliding-window layers' rotary base: set sliding_window_layers too.")
        require(not isinstance(self.moe_layer_freq, list) or len(self.moe_layer_freq) == self.num_layers,
                 f"moe_layer_freq as a list needs one 0/1 flag per layer ({self.num_layers}), "
                 f"got {len(self.moe_layer_freq) if isinstance(self.moe_layer_freq, list) else 0}.")
        require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                 f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                 f"{self.num_attention_heads}; set kv_channels (head dim) explicitly or change one of them.")
        require(self.attention_backend in ("sdpa", "unfused"),
                 f"attention_backend {self.attention_backend!r}: one of 'sdpa' (PyTorch's fused attention) or "
                 f"'unfused' (Megatron-Core's DotProductAttention).")
        groups = self.query_groups
        require(self.num_attention_heads % groups == 0,
                 f"num_attention_heads {self.num_attention_heads} is not divisible by num_query_groups "
                 f"{groups}; grouped-query attention needs whole groups of query heads per KV head.")
        require(self.moe_aux_loss_coeff >= 0 and (self.moe_z_loss_coeff or 0) >= 0,
                 f"moe_aux_loss_coeff {self.moe_aux_loss_coeff} and moe_z_loss_coeff {self.moe_z_loss_coeff} must "
                 f"be >= 0 (a negative weight rewards imbalance); use 0 to switch a loss off.")
        if self.num_experts is not None:
            require(any(self.moe_flags),
                     f"num_experts {self.num_experts} with no MoE layer (moe_layer_freq {self.moe_layer_freq}); make at "
                     f"least one layer MoE, or set num_experts=None for a dense model.")
            require(self.moe_router_topk <= self.num_experts,
                     f"moe_router_topk {self.moe_router_topk} exceeds num_experts {self.num_experts}; "
                     f"a token cannot be routed to more experts than exist.")
            require(self.moe_router_load_balancing_type != "sinkhorn" or self.moe_router_topk == 1,
                     f"sinkhorn load balancing supports top-1 routing only, got moe_router_topk "
                     f"{self.moe_router_topk}; use aux_loss or set moe_router_topk=1.")
            require(self.moe_router_load_balancing_type != "sinkhorn" or self.moe_aux_loss_coeff == 0,
                     f"sinkhorn balances by assignment and refuses an aux loss; set moe_aux_loss_coeff=0 "
                     f"(got {self.moe_aux_loss_coeff}).")
            require(not self.moe_router_enable_expert_bias or self.moe_router_score_function == "sigmoid",
                     "moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid' (the bias "
                     "shifts sigmoid scores); set the score function or disable the bias.")
            capacity = self.moe_expert_capacity_factor
            require(capacity is None or (capacity > 0 and self.moe_router_load_balancing_type != "sinkhorn"),
                     f"moe_expert_capacity_factor {capacity} must be > 0 (None: dropless) and works with the "
                     f"aux-loss balancing types, not sinkhorn ({self.moe_router_load_balancing_type!r}).")
            require(not self.moe_pad_expert_input_to_capacity or capacity is not None,
                     "moe_pad_expert_input_to_capacity=True pads to a capacity; set moe_expert_capacity_factor.")
        if self.multi_latent_attention:
            positive(self, "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
            require(self.kv_channels == self.qk_head_dim + self.qk_pos_emb_head_dim,
                     f"with multi-latent attention kv_channels is the query/key head width qk_head_dim + "
                     f"qk_pos_emb_head_dim = {self.qk_head_dim + self.qk_pos_emb_head_dim}, got {self.kv_channels}.")
        require(self.yarn is None or not self.multi_latent_attention or self.yarn.get("truncate", 1) == 1,
                 "yarn with truncate=0 (an unrounded correction range) is built by GPTModel's YaRN rotary, not by "
                 "multi-latent attention's; remove truncate or set it to 1.")
        require(self.yarn is None or self.multi_latent_attention or self.rotary_percent == 1.0,
                 f"yarn with rotary_percent {self.rotary_percent}: GPTModel's YaRN rotary turns whole heads; positions "
                 f"would differ. Use rotary_percent=1.0 or no yarn.")
        require(not (self.attention_sinks and self.attention_dropout > 0),
                 f"attention_dropout {self.attention_dropout} with attention sinks: the cookbook's sink attention has no "
                 f"dropout (Megatron-Core's unfused softmax, which has, puts a sliding window's mask in place of the "
                 f"padding's); GPT-OSS trains without it: set attention_dropout=0.")
        require((self.glu_clamp is None and self.glu_linear_offset == 0.0) or self.gated,
                 f"glu_clamp and glu_linear_offset shape a gated MLP's halves; activation {self.activation!r} is not "
                 f"gated.")
        if self.hybrid_pattern is not None:
            symbols = set(self.hybrid_pattern)
            require(len(self.hybrid_pattern) == self.num_layers and symbols <= set(HYBRID_LAYERS),
                     f"hybrid_pattern {self.hybrid_pattern!r}: one symbol per layer ({self.num_layers}), each of "
                     f"{HYBRID_LAYERS} ('M' Mamba-2, 'G' gated DeltaNet, '*' attention, '-' MLP, 'E' experts).")
            require("G" not in symbols or (self.gdn_key_heads and self.gdn_value_heads
                                           and self.gdn_value_heads % self.gdn_key_heads == 0),
                     f"gdn_value_heads {self.gdn_value_heads} must be set and a multiple of gdn_key_heads "
                     f"{self.gdn_key_heads} (each key head serves whole value heads).")
            positive(self, "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups",
                     "mamba_conv_kernel", "mamba_chunk_size")
            require("M" not in symbols or (self.mamba_num_heads is not None
                                           and self.mamba_num_heads % self.mamba_num_groups == 0),
                     f"mamba_num_heads {self.mamba_num_heads} must be set and divisible by mamba_num_groups "
                     f"{self.mamba_num_groups} (whole groups of heads share B and C).")
            require(self.is_moe == ("E" in symbols) and not self.multi_latent_attention and self.sliding_window is None,
                     f"a hybrid pattern's experts are its 'E' layers (num_experts {self.num_experts} with pattern "
                     f"{self.hybrid_pattern!r}); multi-latent attention and sliding windows in a hybrid model are not "
                     f"built by the cookbook.")
        if self.num_experts is not None and self.moe_router_num_groups is not None:
            groups, picked = self.moe_router_num_groups, self.moe_router_group_topk
            require(self.num_experts % groups == 0 and picked is not None and 0 < picked <= groups,
                     f"group-limited routing needs num_experts ({self.num_experts}) divisible by moe_router_num_groups "
                     f"({groups}) and 0 < moe_router_group_topk ({picked}) <= moe_router_num_groups.")
        if self.position_embedding_type == "rope":
            # Rotary's slowest component turns once every 2*pi*base tokens (times the scaling factor of Llama 3's or
            # YaRN's scaling, which stretch the slow components): past that, distant positions alias onto near ones.
            stretch = (self.yarn or {}).get("factor") or self.rope_scaling_factor or 1.0
            longest_wavelength = 2 * math.pi * self.rotary_base * stretch
            require(self.max_position_embeddings <= longest_wavelength,
                     f"max_position_embeddings {self.max_position_embeddings} exceeds rotary's longest "
                     f"wavelength 2*pi*rotary_base x scaling = {longest_wavelength:.0f} tokens (rotary_base "
                     f"{self.rotary_base:g}, scaling x{stretch:g}); raise rotary_base (Llama 3 uses 500000) or shorten "
                     f"the context.")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid_pattern is not None

    # The recurrent layers' widths: a Mamba-2 layer's inside (x, z) and convolved channels (x, then every group's B and
    # C); a gated DeltaNet's query (and key) and value (and gate) widths.
    mamba_inner = property(lambda self: (self.mamba_num_heads or 0) * self.mamba_head_dim)
    mamba_conv_channels = property(lambda self: self.mamba_inner + 2 * self.mamba_num_groups * self.mamba_state_dim)
    gdn_key_dim = property(lambda self: (self.gdn_key_heads or 0) * self.gdn_key_head_dim)
    gdn_value_dim = property(lambda self: (self.gdn_value_heads or 0) * self.gdn_value_head_dim)

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (a gate and an up projection: SwiGLU, GeGLU)."""
        return self.activation in ("swiglu", "geglu", "quick_geglu")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_flags(self) -> list[bool]:
        """Which layers are MoE by `moe_layer_freq` (every n-th from the first, or one 0/1 flag per layer), one per
        layer; said of the pattern, whether or not the model has experts. A hybrid's are its 'E' layers."""
        if self.is_hybrid:
            return [kind == "E" for kind in self.hybrid_pattern]
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return [bool(f) for f in freq]
        return [i % freq == 0 for i in range(self.num_layers)]

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Embedding rows after padding to a multiple of make_vocab_size_divisible_by x TP."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def summary(self) -> str:
        """The fields that shape this model, in one line for a reader (the full record is `dataclasses.asdict`)."""
        attention = f"{self.num_attention_heads} attention heads of {self.head_dim}"
        if self.multi_latent_attention:
            attention = (f"{self.num_attention_heads} multi-latent attention heads of {self.qk_head_dim}+"
                         f"{self.qk_pos_emb_head_dim} (KV latent {self.kv_lora_rank}, query latent {self.q_lora_rank})")
        elif self.query_groups != self.num_attention_heads:
            attention += f" ({self.query_groups} KV groups)"
        parts = [f"{self.family}: {self.num_layers} layers", f"hidden {self.hidden_size}", attention,
                 f"{self.activation} MLP {self.ffn_hidden_size}", f"{self.normalization}",
                 f"vocabulary {self.vocab_size:,}",
                 f"RoPE base {self.rotary_base:,.0f}" if self.position_embedding_type == "rope"
                 else "no position embedding" if self.position_embedding_type == "none"
                 else f"{self.position_embedding_type} positions"]
        if self.is_hybrid:
            kinds = {"M": "Mamba-2", "G": "gated DeltaNet", "*": "attention", "-": "MLP", "E": "MoE"}
            counts = ", ".join(f"{self.hybrid_pattern.count(k)} {name}" for k, name in kinds.items()
                               if k in self.hybrid_pattern)
            parts[0] += f" ({counts}: {self.hybrid_pattern})" if len(self.hybrid_pattern) <= 16 else f" ({counts})"
            if "M" in self.hybrid_pattern:
                parts.insert(2, f"Mamba-2 {self.mamba_num_heads} heads of {self.mamba_head_dim} in "
                                f"{self.mamba_num_groups} groups, state {self.mamba_state_dim}")
            if "G" in self.hybrid_pattern:
                parts.insert(2, f"gated DeltaNet {self.gdn_key_heads} key heads of {self.gdn_key_head_dim}, "
                                f"{self.gdn_value_heads} value heads of {self.gdn_value_head_dim}")
        if self.is_moe:
            parts.append(f"MoE: {self.num_experts} experts of {self.moe_ffn_hidden_size or self.ffn_hidden_size}, "
                         f"top-{self.moe_router_topk}"
                         + (f" + a shared expert of {self.moe_shared_expert_intermediate_size}"
                            if self.moe_shared_expert_intermediate_size else ""))
        if self.tie_word_embeddings:
            parts.append("tied embeddings")
        return ", ".join(parts)
