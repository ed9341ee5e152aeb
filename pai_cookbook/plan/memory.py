"""Peak memory per GPU of a layout, split into the terms that make it up (docs/planning.md has each formula).

`stage_memory` predicts one rank of each pipeline stage; `peak_memory` is the most loaded of them. Four terms are
what `core.measures.memory_probe` measures and tests/test_plan.py holds within 5% of a CPU run: weights, gradients, optimizer
(`plan.states`) and activations (`plan.activations`). Two are not measurable on the CPU and are stated as assumptions:
- transient: the loss's working copies of the logits that are not saved for backward. On the local spec (the
  assumption the CPU check could not test): the output layer's logits in e, a transposed copy and the fp32 copy,
  s b V/t (2e + 4) on the last stage, s b V/t x 2e in fp32. On Transformer Engine's path, read off Megatron-Core's
  loss (`vocab_parallel_cross_entropy` makes the fp32 copy it saves from the logits, then works in place): the logits in
  e while that copy is made, and as many again where the vocabulary is padded (the cookbook's mask of the padding rows
  writes a new tensor), s b V/t e (x 2 padded);
- overhead: `FRAMEWORK_OVERHEAD_GIB`, the CUDA context, NCCL's communicators and the caching allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from pai_cookbook.core.configs.config import RunConfig
from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.core.machine.build import LOCAL_LAYERS
from pai_cookbook.plan import activations, states
from pai_cookbook.plan.layouts import Layout, Workload, from_run_config

FRAMEWORK_OVERHEAD_GIB = 1.5
"""Assumed, not measured by this project: ~0.5 GiB CUDA context (H100, torch 2.x), ~0.5 GiB of NCCL buffers for the
communicators a step uses, ~0.5 GiB of the caching allocator's fragmentation and cuBLAS/TE workspaces. Bounded by
NVIDIA's published layouts, which run on 80 GB H100s: with the rest of this model they leave 1.7 GiB (NeMo's Llama-3-8B,
TP1 PP1 CP2) and 2.6 GiB (Llama-3-70B, TP4 PP4 VPP5 CP2) for it (docs/planning.md, tests/test_plan.py)."""
MEASURED = ("weights", "gradients", "optimizer", "activations")
"""The terms `core.measures.memory_probe` measures."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline stage `stage` holds at its peak, by term."""

    stage: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    transient: int
    overhead: int
    in_flight: int
    """Micro-batch chunks whose activations are held at the activation peak."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.transient + self.overhead

    def terms(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k not in ("stage", "in_flight")} | {"total": self.total}


def stage_memory(model: ModelConfig, layout: Layout, workload: Workload, world: int, stage: int,
                 overhead_gib: float = FRAMEWORK_OVERHEAD_GIB) -> StageMemory:
    """The terms of one rank of pipeline stage `stage` (module doc)."""
    held = states.states(model, layout, workload, world, stage)
    peak, in_flight = activations.peak_bytes(model, layout, workload, world, stage)
    transient = 0
    if stage == layout.pp - 1:
        x = activations.dims(layout, workload)
        vocab = model.padded_vocab_size(layout.tp) // layout.tp
        if x.te:
            transient = x.s * x.b * vocab * x.e * (1 + (model.padded_vocab_size(layout.tp) != model.vocab_size))
        else:
            transient = x.s * x.b * vocab * (2 * x.e + (activations.FP32 if x.e != activations.FP32 else 0))
    return StageMemory(stage=stage, weights=held.weights, gradients=held.gradients, optimizer=held.optimizer,
                       activations=peak, transient=transient, overhead=round(overhead_gib * 2**30),
                       in_flight=in_flight)


def all_stages(model: ModelConfig, layout: Layout, workload: Workload, world: int,
               overhead_gib: float = FRAMEWORK_OVERHEAD_GIB) -> list[StageMemory]:
    return [stage_memory(model, layout, workload, world, s, overhead_gib) for s in range(layout.pp)]


def peak_memory(model: ModelConfig, layout: Layout, workload: Workload, world: int,
                overhead_gib: float = FRAMEWORK_OVERHEAD_GIB) -> StageMemory:
    """The most loaded pipeline stage's terms: the memory a GPU must have for this layout."""
    return max(all_stages(model, layout, workload, world, overhead_gib), key=lambda m: m.total)


def expert_rank_load(router: list[dict[str, Any]], model: ModelConfig, layout: Layout, world: int, rank: int) -> float:
    """The routed tokens this rank's experts took over the mean expert-parallel rank's, at the run's heaviest step,
    from its router figures (`train.run(...)["router"]`, each step's `expert_load`): per step and MoE layer of the
    rank's pipeline stage, the shares of its block of E / EP experts (Megatron-Core's placement; expert ranks are
    ordered expert-TP, EP, DP, PP) times EP; over the layers the largest under full recompute (the recomputed layer is
    the peak) and the mean otherwise (every layer's tokens are held at once); over the steps the largest."""
    moe_layers = [n for n, moe in enumerate(model.moe_flags) if moe]  # the layers expert_load lists (RouterStats)
    stage = rank // (world // layout.pp)
    mine = {n for c in range(layout.vpp or 1) for n in states.chunk_layers(model, layout, stage, c)}
    rows = [i for i, n in enumerate(moe_layers) if n in mine]
    if not rows or not router:  # a stage of dense layers alone holds the same whatever the routing
        return 1.0
    per_rank = model.num_experts // layout.ep
    first = (rank % (world // layout.pp)) // (layout.etp or layout.tp) % layout.ep * per_rank
    combine = max if layout.recompute == "full" else (lambda xs: sum(xs) / len(xs))
    return max(combine([sum(step["expert_load"][i][first:first + per_rank]) * layout.ep for i in rows])
               for step in router)


def compare(config: RunConfig, world: int, measured: list[dict[str, int]],
            router: list[dict[str, Any]] | None = None, layers: str = LOCAL_LAYERS, device: str = "cpu") -> list[dict]:
    """What each rank of a run held beside what the plan predicts for its pipeline stage.

    Args:
        config: the run (trained with `measure_memory=True`).
        world: its processes.
        measured: every rank's bytes per term of `MEASURED`, in rank order (the run's result["memory"]).
        router: the run's router figures (result["router"]), for dropless MoE at EP > 1: each rank is then predicted
            at its experts' measured load (`expert_rank_load`; `Workload.moe_imbalance`, at least 1.0: a rank below
            the mean is predicted as balanced, an upper bound) instead of balanced routing.
        layers: the layer path it built (its result["layers"]["layers"]): the local spec, or the CPU path.
        device: "cpu", or "cuda" for a run on a GPU.
    Returns:
        One row per rank and term of `MEASURED`, then their "sum": {"rank", "stage", "term", "measured", "predicted",
        "relative_error"} (|predicted - measured| / measured).
    """
    layout, workload = from_run_config(config, layers, device)
    m = config.model
    routed_varies = m.moe_expert_capacity_factor is None or not m.moe_pad_expert_input_to_capacity  # not padded
    rows = []
    for rank, held in enumerate(measured):
        stage = rank // (world // layout.pp)  # Megatron-Core's rank order puts PP outermost
        loaded = workload
        if router and m.is_moe and layout.ep > 1 and routed_varies:
            load = expert_rank_load(router, m, layout, world, rank)
            loaded = replace(workload, moe_imbalance=max(1.0, load))
        predicted = stage_memory(m, layout, loaded, world, stage).terms()
        for term in MEASURED + ("sum",):
            pair = [sum(side[k] for k in MEASURED) if term == "sum" else side[term] for side in (held, predicted)]
            rows.append({"rank": rank, "stage": stage, "term": term, "measured": pair[0], "predicted": pair[1],
                         "relative_error": abs(pair[1] - pair[0]) / pair[0]})
    return rows
