"""Which parallel layouts fit a model and a world: decided here and nowhere else.

A layout is a `ParallelConfig` (TP, PP, virtual PP, EP, expert-TP, sequence parallel). Whether it fits
depends on the model (heads, KV groups, layers, experts), the world (processes in the job), the device
and what the job does with it:
- "train": every rule, plus Megatron-Core's training-only rule that MoE at TP > 1 needs sequence
  parallelism (its MoE layer raises it in the first training forward);
- "load": the structural rules only (converting, resharding, upcycling, logits parity);
- "infer": the structural rules, plus what Megatron-Core's static inference engine does not run
  (interleaved PP, sequence parallelism, TP together with EP).

`record` is the one description of a layout that checkpoints store (`saved_at`) and resumes compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pai_cookbook.core.configs.model_config import ConfigError, ModelConfig, positive, require


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is split over processes. Data parallelism is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: each layer's matrices split over this many ranks (within a node: it all-reduces per layer)."""
    pipeline_model_parallel_size: int = 1
    """PP: layers split into this many consecutive stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved schedule: model chunks per pipeline rank (needs PP > 1); None disables it."""
    expert_model_parallel_size: int = 1
    """EP: routed experts split over this many ranks."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP; None means the same as tensor_model_parallel_size."""
    sequence_parallel: bool = False
    """Split layer norms and dropout along the sequence over the TP group (needs TP > 1)."""

    def __post_init__(self) -> None:
        positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                  "expert_tensor_parallel_size")
        require(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
                 "sequence_parallel=True needs tensor_model_parallel_size > 1 (it splits activations over "
                 "the TP group); set sequence_parallel=False or raise TP.")
        require(self.virtual_pipeline_model_parallel_size is None or self.pipeline_model_parallel_size > 1,
                 f"virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size} needs "
                 f"pipeline_model_parallel_size > 1, got {self.pipeline_model_parallel_size}; "
                 f"set it to None or raise PP.")

    @property
    def expert_tp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world_size / (TP x PP); raises if it does not divide."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        require(world_size % (tp * pp) == 0,
                 f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}; "
                 f"use a number of processes that is a multiple of {tp * pp}.")
        return world_size // (tp * pp)


Purpose = Literal["train", "load", "infer"]
PURPOSES = ("train", "load", "infer")


def world_size(parallel: ParallelConfig) -> int:
    """The smallest number of processes that holds a layout: PP x lcm(TP, EP x expert-TP)."""
    return parallel.pipeline_model_parallel_size * math.lcm(parallel.tensor_model_parallel_size,
                                                             parallel.expert_model_parallel_size * parallel.expert_tp)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def working_tps(m: ModelConfig) -> list[int]:
    """The tensor-parallel sizes the model's shape takes: each divides the heads, the KV groups, the MLP's width (and a
    latent attention's latents), so a refusal names only sizes that pass every one of these checks."""
    sizes = [m.num_attention_heads, m.query_groups, m.ffn_hidden_size]
    if m.multi_latent_attention:
        sizes += [m.kv_lora_rank + m.qk_pos_emb_head_dim] + ([m.q_lora_rank] if m.q_lora_rank else [])
    if m.is_hybrid and "M" in m.hybrid_pattern:
        sizes += [m.mamba_num_heads, m.mamba_num_groups]
    if m.is_hybrid and "G" in m.hybrid_pattern:
        sizes += [m.gdn_key_heads, m.gdn_value_heads]
    return [t for t in divisors(m.num_attention_heads) if all(s % t == 0 for s in sizes)]


def check(model: ModelConfig, parallel: ParallelConfig, world: int | None = None, *, purpose: Purpose = "train",
          device: Any = None) -> int:
    """Refuse a layout that does not fit `model` on `world` processes of `device` for `purpose`.

    Args:
        world: processes in the job; None means the layout's own smallest world (`world_size`).
        device: a `runtime.DeviceInfo`; None skips the hardware rules.
    Returns:
        The data-parallel size.
    Raises:
        ConfigError: naming the offending value and the fix.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"purpose {purpose!r} is not one of {PURPOSES}")
    m, p = model, parallel
    world = world_size(p) if world is None else world
    tp, pp, vpp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    dp = p.data_parallel_size(world)
    require(m.num_attention_heads % tp == 0,
             f"num_attention_heads {m.num_attention_heads} is not divisible by TP={tp}: TP={tp} must divide the "
             f"{m.num_attention_heads} attention heads (each TP rank needs whole heads). Use TP in "
             f"{working_tps(m)}.")
    require(m.query_groups % tp == 0,
             f"num_query_groups {m.query_groups} is not divisible by TP={tp}: TP={tp} must divide the "
             f"{m.query_groups} KV groups (each TP rank needs whole KV heads). Use TP in {working_tps(m)}.")
    require(m.ffn_hidden_size % tp == 0, f"ffn_hidden_size {m.ffn_hidden_size} is not divisible by TP={tp}. Use TP in "
                                         f"{working_tps(m)}.")
    if m.multi_latent_attention:
        _check_latent_attention(m, tp)
    if m.is_hybrid:
        _check_hybrid(m, tp, vpp)
    stages = pp * (vpp or 1)
    splitter = f"PP x VPP = {stages}" if vpp else f"PP={pp}"
    require(m.num_layers % stages == 0,
             f"num_layers {m.num_layers} is not divisible by PP x virtual PP = {pp} x {vpp or 1}: {splitter} must "
             f"divide the {m.num_layers} layers (each pipeline chunk needs the same number of layers). Use PP x VPP "
             f"in {divisors(m.num_layers)}.")
    if m.is_moe:
        ep, etp = p.expert_model_parallel_size, p.expert_tp
        require(m.num_experts % ep == 0,
                 f"num_experts {m.num_experts} is not divisible by EP={ep}; each EP rank holds "
                 f"num_experts / EP whole experts. Use EP in {divisors(m.num_experts)}.")
        require(not m.add_bias_linear or etp == 1,
                 f"{m.family}: experts with biases are built by Megatron-Core at expert_tensor_parallel_size 1 only, got "
                 f"{etp} (None means TP's, {tp}); set expert_tensor_parallel_size=1" + (
                     ", and to train at TP > 1 expert_model_parallel_size > 1." if tp > 1 else "."))
        require(world % (ep * etp * pp) == 0,
                 f"world size {world} is not divisible by EP x expert-TP x PP = {ep} x {etp} x {pp}.")
        require(m.moe_token_dispatcher_type != "flex" or getattr(device, "is_cuda", True),
                 "moe_token_dispatcher_type='flex' needs DeepEP on GPUs; use 'alltoall' on this machine.")
        require(not (m.moe_grouped_gemm and device is not None and not device.is_cuda),
                 "moe_grouped_gemm=True needs CUDA (grouped_gemm or Transformer Engine); set it to None "
                 "to run experts as a per-expert loop on CPU.")
        # Measured on megatron-core 0.16.1: with EP=1 and expert-TP != TP the expert gradients are all-reduced across
        # different expert shards, so they are silently wrong (a forward is right: loading, scoring, generating).
        require(purpose != "train" or ep > 1 or etp == tp,
                 f"expert_tensor_parallel_size {etp} != tensor_model_parallel_size {tp} with expert_model_parallel_size "
                 f"1 gives wrong expert gradients in Megatron-Core; to train, use expert_model_parallel_size > 1 or set "
                 f"expert_tensor_parallel_size equal to TP.")
        # Megatron-Core's MoE layer raises this in the first training forward (inference is fine without SP).
        require(purpose != "train" or tp == 1 or p.sequence_parallel,
                 f"training an MoE model at TP={tp} needs sequence_parallel=True (each TP rank routes its own "
                 f"slice of the sequence).")
    elif p.expert_model_parallel_size > 1:
        raise ConfigError(f"expert_model_parallel_size {p.expert_model_parallel_size} is set for a dense "
                          f"model (num_experts=None); set it to 1.")
    if purpose == "infer":
        _check_inference(p)
    return dp


def _check_latent_attention(m: ModelConfig, tp: int) -> None:
    """Multi-latent attention: the Megatron-Core release, and the down projections, whose outputs the local spec splits
    over TP ranks."""
    from pai_cookbook.core.machine import versions

    require(versions.minor() >= (0, 17),
             f"multi-latent attention ({m.family}) on Megatron-Core {versions.megatron_core_version()}: the cookbook runs "
             f"it from 0.17 on (0.16 builds it only with Transformer Engine, and its local spec trains the rotary key at "
             f"TP > 1 from one rank's heads). Install megatron-core{versions.MEGATRON_CORE} at 0.17 or later.")
    kv = m.kv_lora_rank + m.qk_pos_emb_head_dim
    require(m.q_lora_rank is None or m.q_lora_rank % tp == 0,
             f"q_lora_rank {m.q_lora_rank} is not divisible by TP={tp} (the query latent is split over TP ranks). Use "
             f"TP in {working_tps(m)}.")
    require(kv % tp == 0, f"kv_lora_rank + qk_pos_emb_head_dim = {kv} is not divisible by TP={tp} (the key/value latent "
                          f"is split over TP ranks). Use TP in {working_tps(m)}.")


def _check_hybrid(m: ModelConfig, tp: int, vpp: int | None) -> None:
    """A hybrid model (Mamba-2 layers): the Megatron-Core release that builds it, and the Mamba heads and groups, which
    TP splits whole."""
    from pai_cookbook.core.machine import versions

    require(versions.minor() >= (0, 19),
             f"{m.family} is a hybrid model (Mamba-2 or gated DeltaNet layers), built by Megatron-Core's HybridModel "
             f"from 0.19 on; "
             f"Megatron-Core {versions.megatron_core_version()} is installed. Install megatron-core{versions.MEGATRON_CORE} "
             f"at 0.19 or later.")
    if "M" in m.hybrid_pattern:
        require(m.mamba_num_groups % tp == 0 and m.mamba_num_heads % tp == 0,
                 f"TP={tp} must divide the Mamba-2 layers' {m.mamba_num_heads} heads and {m.mamba_num_groups} groups "
                 f"(each TP rank holds whole groups). Use TP in {working_tps(m)}.")
    if "G" in m.hybrid_pattern:
        require(m.gdn_key_heads % tp == 0, f"TP={tp} must divide the gated DeltaNet layers' {m.gdn_key_heads} key heads "
                                           f"(each TP rank holds whole key heads and their value heads). Use TP in "
                                           f"{working_tps(m)}.")
    require(vpp is None, f"virtual pipeline parallelism ({vpp}) for a hybrid model: its stages are set by '|' in "
                         f"Megatron-Core's layer pattern, which the cookbook does not write; set it to None.")


def _check_inference(p: ParallelConfig) -> None:
    """Layouts Megatron-Core's static inference runs: TP, PP, EP (not interleaved PP, SP, or TP with EP)."""
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    require(p.virtual_pipeline_model_parallel_size is None,
             "virtual pipeline parallelism is not supported by Megatron-Core inference; set "
             "virtual_pipeline_model_parallel_size=None (the checkpoint loads at any layout).")
    require(not p.sequence_parallel, "sequence_parallel=True is not supported by Megatron-Core's static inference "
                                      "for these models; set it to False (it saves activation memory in training, "
                                      "not in generation).")
    require(not (tp > 1 and ep > 1), f"TP={tp} with EP={ep}: Megatron-Core's static inference then needs "
                                      f"sequence-parallel MoE layers; use TP or EP alone.")


_AXES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "ep": "expert_model_parallel_size"}


def for_model(model: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1, **fields: Any) -> ParallelConfig:
    """ParallelConfig(TP, PP, EP, `fields`) for `model`: its experts at expert-TP 1 where they have biases (GPT-OSS's:
    the only expert-TP Megatron-Core builds them at; `check` refuses the default, TP's, by name), else as given."""
    if model.is_moe and model.add_bias_linear:
        fields.setdefault("expert_tensor_parallel_size", 1)
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                          **fields)


def largest(model: ModelConfig, axis: Literal["tp", "pp", "ep"], at_most: int, purpose: str = "load") -> int:
    """The largest size up to `at_most` of one parallel axis (the others at 1) that `check` accepts for `model`: a
    notebook's default layout, derived from the model the user brings (SmolLM2's 9 heads in 3 KV groups take TP=3, a
    model with 2 KV groups TP=2; a dense model EP=1). The rules are `check`'s, so the default is never refused."""
    for size in range(at_most, 1, -1):
        try:
            check(model, for_model(model, **{axis: size}), purpose=purpose)
            return size
        except ConfigError:
            continue
    return 1


def record(parallel: ParallelConfig, world: int) -> dict[str, int]:
    """The layout a checkpoint was saved at, as `pai_cookbook.json` stores it under "saved_at"."""
    p = parallel
    return {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size or 1, "ep": p.expert_model_parallel_size,
            "etp": p.expert_tp, "world": world}


def same_layout(saved: dict[str, int], wanted: dict[str, int]) -> bool:
    """Whether a resume at `wanted` matches the `saved` record (records written before a field existed
    are compared on the fields they have)."""
    return all(wanted.get(key) == value for key, value in saved.items())
