"""LoRA's knobs (`LoRAConfig`), checked when built: which of Megatron-Core's parallel linears get adapters, their rank,
scale and dropout. `core.modeling.lora` builds the adapters; `RunConfig.lora` asks for them.

LoRA (Hu et al., 2021) trains, beside a frozen weight W of a linear layer, two small matrices: A (rank x in) and
B (out x rank), B starting at zero, so the layer computes W x + (alpha / rank) B A x and starts as the base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pai_cookbook.core.configs.model_config import require
from pai_cookbook.core.machine import build

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The parallel linears of Megatron-Core's GPT layer that can take an adapter: attention's fused query/key/value and
output projections, the MLP's first (gate and up, fused) and second linears."""
PARTS = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}
"""The projections a fused target holds, in the order of its rows (a gated FC1; a plain one is one projection): each
gets an adapter of its own, as each Hugging Face module does under PEFT."""
PEFT_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""Hugging Face's module names for each target's parts (Llama's, which Mistral, Qwen and the other families the
cookbook converts share): what an exported PEFT adapter's `target_modules` lists."""


def peft_part(module: str) -> tuple[str, int]:
    """(target, part index) of a Hugging Face module name (`q_proj` is part 0 of `linear_qkv`)."""
    for target, names in PEFT_NAMES.items():
        if module in names:
            return target, names.index(module)
    raise ValueError(f"{module!r} is none of PEFT's LoRA modules here ({sorted(sum(PEFT_NAMES.values(), ()))})")


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters on the frozen model: only they have gradients and optimizer state."""

    rank: int = 8
    """r: the adapters' inner width."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's `lora_dropout`); 0 in the tests that compare with PEFT."""
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    """Which linears of every layer get an adapter: a subset of `TARGETS`."""

    def __post_init__(self) -> None:
        require(isinstance(self.rank, int) and self.rank >= 1,
                f"LoRA rank {self.rank!r} must be an integer >= 1 (8 to 64 is usual).")
        require(self.alpha > 0, f"LoRA alpha {self.alpha!r} must be > 0 (the adapter's scale is alpha / rank).")
        require(0.0 <= self.dropout < 1.0, f"LoRA dropout {self.dropout!r} must lie in [0, 1).")
        unknown = [t for t in self.targets if t not in TARGETS]
        require(self.targets and not unknown,
                f"LoRA targets {list(self.targets)}: {unknown or 'none given'} matches no adapter target; give some of "
                f"{list(TARGETS)} (Megatron-Core's names: q/k/v are linear_qkv, o_proj linear_proj, gate/up "
                f"linear_fc1, down linear_fc2).")

    def check(self, model) -> None:
        """Refuse adapters the model (a `ModelConfig`) has no place for, or a rank above a target's width."""
        require(not model.is_hybrid, f"LoRA on a hybrid model ({model.family}: Mamba-2 or gated DeltaNet layers) is "
                                     f"not built yet: its attention and MLP layers would take adapters, its recurrent "
                                     f"mixers none, and neither is checked against PEFT. Fine-tune it fully (RunConfig "
                                     f"without lora).")
        h, f, heads = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
        # (in, out) of each target's narrowest part: a key/value projection is query_groups heads wide
        present = {"linear_proj": (heads * (model.v_head_dim if model.multi_latent_attention else model.head_dim), h)}
        if not model.multi_latent_attention:  # multi-latent attention's projections have other names
            present["linear_qkv"] = (h, model.query_groups * model.head_dim)
        if not model.is_moe or not all(model.moe_flags):  # dense MLPs (an MoE layer's experts take no adapter here)
            present |= {"linear_fc1": (h, f), "linear_fc2": (f, h)}
        found = [t for t in self.targets if t in present]
        require(found, f"LoRA targets {list(self.targets)}: none is in this {model.family} model (it has "
                       f"{sorted(present)}); target those.")
        narrow = min(min(present[t]) for t in found)
        require(self.rank <= narrow, f"LoRA rank {self.rank} exceeds the narrowest adapted layer's width ({narrow}); "
                                     f"a rank is at most its layer's smaller side: lower it.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def narrow_layers(self, layers: str) -> str:
        """The layers LoRA builds where the machine's are `layers`: the adapters wrap Megatron-Core's local parallel
        linears (Transformer Engine's fuse the input norm into the QKV and FC1 linears, where an adapter cannot reach
        the normalised input), so on a Transformer Engine GPU a LoRA run builds the local spec, and says so
        (`core.launching.job.decided`)."""
        return build.without_te(layers)
