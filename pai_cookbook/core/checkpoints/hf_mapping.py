"""Which Hugging Face tensors make each Megatron-Core parameter, and how (the conversion's known traps).

Megatron names are those of a TP=1, PP=1, EP=1 `GPTModel` (local spec): the whole, unsplit tensors.
Splitting for TP/PP/EP is not done here: Megatron-Core's distributed checkpoint stores whole tensors
as chunks and reshards on load, including the per-rank split of SwiGLU's fused gate/up weight
(its sharded-tensor factory splits gate and up separately, never the concatenation globally).

The traps, each a `kind` below:
- `qkv`: Megatron fuses Q, K, V *per query group*: [q of group 0 (heads/groups x head_dim rows), k_0, v_0,
  q_1, k_1, v_1, ...], so that a TP split of whole groups keeps each head with its KV head (GQA).
- `gate_up`: SwiGLU's fc1 is cat(gate, up); Megatron applies silu to the first half.
- `vocab`: embedding and output rows are padded to `ModelConfig.padded_vocab_size(TP)` with zeros, and
  cut back on export. (A zero output row gives logit 0 for a token id that never occurs.)
- `copy`: the same tensor (norms, o_proj, down_proj, router, QK norms, shared-expert gate, attention sinks).
- Experts stored stacked (GPT-OSS: one `[experts, in, out]` tensor per projection, `x @ W`'s orientation, its gate and
  up columns interleaved): the Hugging Face name `name[e]` is row e of the stacked tensor `name`. `gate_up_t` is
  such a row transposed, its even rows the gate and its odd rows the up projection (`gate_up_i` the same for a bias),
  `transpose` a down projection's row; the export stacks the rows back (`stacked`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pai_cookbook.core.configs.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    megatron: str
    """Regex over Megatron parameter names; groups `i` (layer) and `e` (expert)."""
    hf: tuple[str, ...]
    """Hugging Face tensor names, formatted with the groups and `moe` (the family's MoE block name)."""
    kind: str


_L = r"decoder\.layers\.(?P<i>\d+)\."
_H = "model.layers.{i}."
_EXPERT = r"mlp\.experts\.local_experts\.(?P<e>\d+)\."

RULES: tuple[Rule, ...] = (
    Rule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule(r"output_layer\.weight", ("lm_head.weight",), "vocab"),
    Rule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), "copy"),
    Rule(_L + r"input_layernorm\.weight", (_H + "input_layernorm.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_qkv\.weight",
         tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule(_L + r"self_attention\.linear_qkv\.bias", tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    Rule(_L + r"self_attention\.linear_proj\.weight", (_H + "self_attn.o_proj.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_proj\.bias", (_H + "self_attn.o_proj.bias",), "copy"),
    Rule(_L + r"self_attention\.core_attention\.softmax_offset", (_H + "self_attn.sinks",), "copy"),
    Rule(_L + r"self_attention\.k_layernorm\.weight", (_H + "self_attn.k_norm.weight",), "copy"),
    # multi-latent attention (DeepSeek-V3): both sides lay each head out as [no-rotary part, rotary part] (queries,
    # keys) and [no-rotary key part, value] (the key/value up-projection), and the key/value down-projection as
    # [latent, shared rotary key]: every tensor is copied.
    Rule(_L + r"self_attention\.linear_q_proj\.weight", (_H + "self_attn.q_proj.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_q_down_proj\.weight", (_H + "self_attn.q_a_proj.weight",), "copy"),
    Rule(_L + r"self_attention\.q_layernorm\.weight", (_H + "self_attn.{q_norm}.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_q_up_proj\.weight", (_H + "self_attn.q_b_proj.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_kv_down_proj\.weight", (_H + "self_attn.kv_a_proj_with_mqa.weight",), "copy"),
    Rule(_L + r"self_attention\.kv_layernorm\.weight", (_H + "self_attn.kv_a_layernorm.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_kv_up_proj\.weight", (_H + "self_attn.kv_b_proj.weight",), "copy"),
    Rule(_L + r"pre_mlp_layernorm\.weight", (_H + "{pre_mlp_norm}.weight",), "copy"),
    # Gemma's norms on the attention's and the MLP's outputs (`core.modeling.gemma`)
    Rule(_L + r"self_attention\.post_layernorm\.weight", (_H + "post_attention_layernorm.weight",), "copy"),
    Rule(_L + r"mlp\.post_layernorm\.weight", (_H + "post_feedforward_layernorm.weight",), "copy"),
    Rule(_L + r"mlp\.linear_fc1\.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up"),
    Rule(_L + r"mlp\.linear_fc2\.weight", (_H + "mlp.down_proj.weight",), "copy"),
    Rule(_L + r"mlp\.router\.weight", (_H + "{moe}.{router}.weight",), "copy"),
    Rule(_L + r"mlp\.router\.bias", (_H + "{moe}.{router}.bias",), "copy"),
    Rule(_L + r"mlp\.router\.expert_bias", (_H + "{moe}.gate.e_score_correction_bias",), "copy"),
    Rule(_L + _EXPERT + r"linear_fc1\.weight", (_H + "{moe}.experts.{e}.{gate}.weight",
                                                _H + "{moe}.experts.{e}.{up}.weight"), "gate_up"),
    Rule(_L + _EXPERT + r"linear_fc2\.weight", (_H + "{moe}.experts.{e}.{down}.weight",), "copy"),
    Rule(_L + r"mlp\.shared_experts\.linear_fc1\.weight",
         (_H + "mlp.{shared}.gate_proj.weight", _H + "mlp.{shared}.up_proj.weight"), "gate_up"),
    Rule(_L + r"mlp\.shared_experts\.linear_fc2\.weight", (_H + "mlp.{shared}.down_proj.weight",), "copy"),
    Rule(_L + r"mlp\.shared_experts\.gate_weight", (_H + "mlp.shared_expert_gate.weight",), "copy"),
)

# Experts stored stacked, one tensor per projection for all of a layer's experts (GPT-OSS); checked before RULES.
STACKED_EXPERT_RULES: tuple[Rule, ...] = (
    Rule(_L + _EXPERT + r"linear_fc1\.weight", (_H + "mlp.experts.gate_up_proj[{e}]",), "gate_up_t"),
    Rule(_L + _EXPERT + r"linear_fc1\.bias", (_H + "mlp.experts.gate_up_proj_bias[{e}]",), "gate_up_i"),
    Rule(_L + _EXPERT + r"linear_fc2\.weight", (_H + "mlp.experts.down_proj[{e}]",), "transpose"),
    Rule(_L + _EXPERT + r"linear_fc2\.bias", (_H + "mlp.experts.down_proj_bias[{e}]",), "copy"),
)
STACKED_EXPERTS = {"gpt_oss"}

# Hybrid models (Nemotron-H): one mixer per layer under `backbone.layers.<i>.mixer` (Mamba-2, attention or MLP) after
# one norm. Megatron-Core's Mamba mixer lays its input projection out as the release does ([z, x, B, C, dt] rows) and
# its convolution as [x, B, C] channels: every tensor is copied, the attention's q/k/v fused as above.
_B = "backbone.layers.{i}."
_MIXER = r"mixer\.(?P<t>in_proj\.weight|dt_bias|A_log|D|norm\.weight|out_proj\.weight)"
HYBRID_RULES: tuple[Rule, ...] = (
    Rule(r"embedding\.word_embeddings\.weight", ("backbone.embeddings.weight",), "vocab"),
    Rule(r"output_layer\.weight", ("lm_head.weight",), "vocab"),
    Rule(r"decoder\.final_norm\.weight", ("backbone.norm_f.weight",), "copy"),
    Rule(_L + r"(?:norm|input_layernorm|pre_mlp_layernorm)\.weight", (_B + "norm.weight",), "copy"),
    Rule(_L + _MIXER, (_B + "mixer.{t}",), "copy"),
    Rule(_L + r"mixer\.conv1d_(?P<t>weight|bias)", (_B + "mixer.conv1d.{t}",), "copy"),
    Rule(_L + r"self_attention\.linear_qkv\.weight", tuple(_B + f"mixer.{p}_proj.weight" for p in "qkv"), "qkv"),
    Rule(_L + r"self_attention\.linear_proj\.weight", (_B + "mixer.o_proj.weight",), "copy"),
    Rule(_L + r"mlp\.linear_fc1\.weight", (_B + "mixer.up_proj.weight",), "copy"),
    Rule(_L + r"mlp\.linear_fc2\.weight", (_B + "mixer.down_proj.weight",), "copy"),
)

# Qwen3-Next: each Hugging Face layer i is two layers of the hybrid stack, 2i (its gated DeltaNet, "linear_attn", or
# gated attention) and 2i + 1 (its experts or dense MLP); `i` below is the Hugging Face layer. The DeltaNet's input
# projection is two tensors grouped per key head ([q, k, v, z] and [beta, alpha] of each), Megatron-Core's one tensor
# of whole parts (`gdn_in`); the gated attention's q_proj interleaves each head's query and gate, Megatron-Core's QKV is
# [queries, gates, k, v] per group (`qkv_gated`).
_D = "model.layers.{i}.linear_attn."
QWEN3_NEXT_RULES: tuple[Rule, ...] = RULES[:2] + (
    Rule(r"decoder\.final_norm\.weight", ("model.norm.weight",), "copy"),
    Rule(_L + r"input_layernorm\.weight", (_H + "input_layernorm.weight",), "copy"),
    Rule(_L + r"pre_mlp_layernorm\.weight", (_H + "post_attention_layernorm.weight",), "copy"),
    Rule(_L + r"self_attention\.in_proj\.weight", (_D + "in_proj_qkvz.weight", _D + "in_proj_ba.weight"), "gdn_in"),
    Rule(_L + r"self_attention\.(?P<t>conv1d\.weight|dt_bias|A_log|out_proj\.weight)", (_D + "{t}",), "copy"),
    Rule(_L + r"self_attention\.out_norm\.weight", (_D + "norm.weight",), "copy"),
    Rule(_L + r"self_attention\.linear_qkv\.weight", tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"),
         "qkv_gated"),
    Rule(_L + r"self_attention\.linear_proj\.weight", (_H + "self_attn.o_proj.weight",), "copy"),
    Rule(_L + r"self_attention\.(?P<t>[qk])_layernorm\.weight", (_H + "self_attn.{t}_norm.weight",), "copy"),
) + tuple(rule for rule in RULES if rule.megatron.startswith(_L + r"mlp\."))  # its MLPs and experts: as Qwen2-MoE's

# How each family names its MoE block and expert projections on disk (the hub format, which is also
# what transformers 5 writes with save_pretrained).
_DENSE_NAMES = {"moe": "mlp", "gate": "gate_proj", "up": "up_proj", "down": "down_proj", "shared": "shared_expert",
                "q_norm": "q_norm", "pre_mlp_norm": "post_attention_layernorm", "router": "gate"}
_MOE_NAMES = {
    "mixtral": _DENSE_NAMES | {"moe": "block_sparse_moe", "gate": "w1", "up": "w3", "down": "w2"},
    "qwen2_moe": _DENSE_NAMES,
    "qwen3_moe": _DENSE_NAMES,
    # the query latent's norm, and the shared experts (plural)
    "deepseek_v3": _DENSE_NAMES | {"shared": "shared_experts", "q_norm": "q_a_layernorm"},
    "glm4_moe": _DENSE_NAMES | {"shared": "shared_experts"},
    # the norm before the MLP (post_attention_layernorm is the one on the attention's output)
    "gemma3_text": _DENSE_NAMES | {"pre_mlp_norm": "pre_feedforward_layernorm"},
    "gpt_oss": _DENSE_NAMES | {"router": "router"},
}


class UnmappedParameter(KeyError):
    """A Megatron parameter no rule knows: the model has a feature the converter does not cover."""


def hf_names(megatron_name: str, model: ModelConfig) -> tuple[str, tuple[str, ...]]:
    """(kind, HF tensor names) that make the Megatron parameter `megatron_name`."""
    names = _MOE_NAMES.get(model.family, _DENSE_NAMES)
    rules = (QWEN3_NEXT_RULES if model.family == "qwen3_next" else HYBRID_RULES if model.is_hybrid
             else (STACKED_EXPERT_RULES if model.family in STACKED_EXPERTS else ()) + RULES)
    for rule in rules:
        match = re.fullmatch(rule.megatron, megatron_name)
        if match:
            groups = match.groupdict()
            if model.family == "qwen3_next" and groups.get("i") is not None:  # two stack layers a Hugging Face layer
                groups["i"] = str(int(groups["i"]) // 2)
            return rule.kind, tuple(h.format(**groups, **names) for h in rule.hf)
    raise UnmappedParameter(f"no Hugging Face mapping for Megatron parameter {megatron_name!r} "
                            f"(family {model.family})")


def stacked(hf_name: str) -> tuple[str, int | None]:
    """(the tensor's name, the row) of a stacked expert's `name[e]`; (hf_name, None) for any other name."""
    match = re.fullmatch(r"(.+)\[(\d+)\]", hf_name)
    return (match[1], int(match[2])) if match else (hf_name, None)


def _interleave(tensor: torch.Tensor) -> torch.Tensor:
    """[gate; up] (Megatron's fc1 rows) -> rows alternating gate, up (GPT-OSS's columns): `_deinterleave`'s inverse."""
    gate, up = torch.chunk(tensor, 2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(tensor.shape)


def _deinterleave(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor[0::2], tensor[1::2]], dim=0)


def _qkv_geometry(model: ModelConfig) -> tuple[int, int, int]:
    groups, head_dim = model.query_groups, model.head_dim
    return groups, model.num_attention_heads // groups * head_dim, head_dim


def _delta_net_parts(model: ModelConfig) -> tuple[int, int, int, int]:
    """(key heads, key head width, value heads per key head, value head width) of a gated DeltaNet."""
    return (model.gdn_key_heads, model.gdn_key_head_dim, model.gdn_value_heads // model.gdn_key_heads,
            model.gdn_value_head_dim)


def to_megatron(kind: str, tensors: list[torch.Tensor], model: ModelConfig, padded_vocab: int) -> torch.Tensor:
    """Build one Megatron parameter from its HF tensors (see the module docstring for the kinds)."""
    if kind == "copy":
        return tensors[0]
    if kind == "gdn_in":  # per key head [q, k, v, z] and [beta, alpha] -> [q, k, v, z, beta, alpha], each whole
        heads, dk, per, dv = _delta_net_parts(model)
        qkvz, ba = tensors
        h = qkvz.shape[1]
        parts = qkvz.view(heads, -1, h).split([dk, dk, per * dv, per * dv], dim=1)
        parts += ba.view(heads, -1, h).split([per, per], dim=1)
        return torch.cat([part.reshape(-1, h) for part in parts])
    if kind == "qkv_gated":  # q_proj's rows per head [query, gate] -> per group [queries, gates, k, v]
        groups, q_rows, head_dim = _qkv_geometry(model)
        q, k, v = tensors
        h = q.shape[1]
        query, gate = q.view(-1, 2, head_dim, h).unbind(1)
        per_group = [query.reshape(groups, q_rows, h), gate.reshape(groups, q_rows, h), k.view(groups, head_dim, h),
                     v.view(groups, head_dim, h)]
        return torch.cat(per_group, dim=1).reshape(-1, h)
    if kind == "gate_up":
        return torch.cat(tensors, dim=0)
    if kind == "gate_up_t":
        return _deinterleave(tensors[0].t())
    if kind == "gate_up_i":
        return _deinterleave(tensors[0])
    if kind == "transpose":
        return tensors[0].t()
    if kind == "qkv":
        groups, q_rows, head_dim = _qkv_geometry(model)
        q, k, v = tensors
        rest = q.shape[1:]
        per_group = [q.reshape(groups, q_rows, *rest), k.reshape(groups, head_dim, *rest),
                     v.reshape(groups, head_dim, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)
    if kind == "vocab":
        (weight,) = tensors
        padding = padded_vocab - weight.shape[0]
        if padding == 0:
            return weight
        return torch.cat([weight, weight.new_zeros(padding, *weight.shape[1:])], dim=0)
    raise ValueError(f"unknown conversion kind {kind!r}")


class NonFiniteWeights(ValueError):
    """A checkpoint tensor holds NaN or Inf: converting it would publish a model that can only produce NaN."""


def check_finite(name: str, tensor: torch.Tensor, where: str) -> torch.Tensor:
    """`tensor`, after checking that every value is finite (done on the tensor the conversion reads anyway, so it
    costs a pass over memory, not over the disk).

    Raises:
        NonFiniteWeights: naming the tensor, the file it came from and how many of its values are NaN / Inf.
    """
    # in pieces: a whole-tensor mask is a byte per value (1.2 GB for a 152k x 8192 embedding) per writer thread
    if tensor.is_floating_point() and not all(bool(torch.isfinite(piece).all())
                                              for piece in tensor.reshape(-1).split(1 << 24)):
        nan = int(torch.isnan(tensor).sum())
        inf = int(torch.isinf(tensor).sum())
        raise NonFiniteWeights(
            f"{name} in {where} holds {nan} NaN and {inf} Inf of its {tensor.numel()} values; the conversion stops "
            f"before publishing anything. The model that wrote it diverged or the file is damaged: convert an earlier "
            f"checkpoint (or the original download) instead.")
    return tensor


def to_hf(kind: str, tensor: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
    """Split one Megatron parameter back into its HF tensors (exact inverse of `to_megatron`)."""
    if kind == "copy":
        return [tensor]
    if kind == "gdn_in":
        heads, dk, per, dv = _delta_net_parts(model)
        h = tensor.shape[1]
        q, k, v, z, b, a = (part.reshape(heads, -1, h) for part in tensor.split(
            [heads * dk, heads * dk, heads * per * dv, heads * per * dv, heads * per, heads * per]))
        return [torch.cat([q, k, v, z], dim=1).reshape(-1, h), torch.cat([b, a], dim=1).reshape(-1, h)]
    if kind == "qkv_gated":
        groups, q_rows, head_dim = _qkv_geometry(model)
        h = tensor.shape[1]
        query, gate, k, v = tensor.view(groups, -1, h).split([q_rows, q_rows, head_dim, head_dim], dim=1)
        q = torch.stack([query.reshape(-1, head_dim, h), gate.reshape(-1, head_dim, h)], dim=1)
        return [q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]
    if kind == "gate_up":
        return list(torch.chunk(tensor, 2, dim=0))
    if kind == "gate_up_t":
        return [_interleave(tensor).t()]
    if kind == "gate_up_i":
        return [_interleave(tensor)]
    if kind == "transpose":
        return [tensor.t()]
    if kind == "qkv":
        groups, q_rows, head_dim = _qkv_geometry(model)
        rest = tensor.shape[1:]
        q, k, v = tensor.reshape(groups, q_rows + 2 * head_dim, *rest).split([q_rows, head_dim, head_dim], dim=1)
        return [x.reshape(-1, *rest) for x in (q, k, v)]
    if kind == "vocab":
        return [tensor[:model.vocab_size]]
    raise ValueError(f"unknown conversion kind {kind!r}")
