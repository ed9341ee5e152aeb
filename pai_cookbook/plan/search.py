"""Rank the layouts of a model on a cluster: every valid one (`plan.layouts.valid_layouts`) with its peak memory per GPU
(`plan.memory`) and step time (`plan.speed`); those that fit, fastest first, then those that do not."""

from __future__ import annotations

from dataclasses import dataclass

from pai_cookbook.core.configs.model_config import ModelConfig, require
from pai_cookbook.core.machine.build import LOCAL_LAYERS, TE_LAYERS
from pai_cookbook.plan import states
from pai_cookbook.plan.hardware import GIB, Cluster
from pai_cookbook.plan.layouts import Layout, Workload, valid_layouts
from pai_cookbook.plan.memory import FRAMEWORK_OVERHEAD_GIB, StageMemory, peak_memory
from pai_cookbook.plan.speed import StepTime, step_time


@dataclass(frozen=True)
class Option:
    """One layout with its predicted peak memory (most loaded stage) and step time."""

    layout: Layout
    memory: StageMemory
    time: StepTime
    fits: bool
    world: int


def evaluate(model: ModelConfig, layout: Layout, workload: Workload, cluster: Cluster,
             overhead_gib: float = FRAMEWORK_OVERHEAD_GIB) -> Option:
    memory = peak_memory(model, layout, workload, cluster.world_size, overhead_gib)
    return Option(layout=layout, memory=memory, time=step_time(model, layout, workload, cluster),
                  fits=memory.total <= cluster.gpu.memory_gib * GIB, world=cluster.world_size)


def plan(model: ModelConfig, cluster: Cluster, workload: Workload, overhead_gib: float = FRAMEWORK_OVERHEAD_GIB,
         micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[Option]:
    """Every valid layout, evaluated: those that fit the GPU's memory fastest first, then the others by memory.

    Raises:
        ConfigError: a sequence longer than the model's positions, or a workload no layout takes on this cluster
        (naming what every layout needs), instead of an empty plan.
    """
    require(workload.seq_length <= model.max_position_embeddings,
            f"seq_length {workload.seq_length} exceeds the model's {model.max_position_embeddings} positions "
            f"(max_position_embeddings); plan a sequence of at most that.")
    gpu = cluster.gpu
    require(workload.dtype != "bf16" or gpu.bf16,
            f"the {gpu.name} has no bf16 tensor cores ({gpu.limits}); plan dtype='fp32'.")
    require(workload.device == "cuda", f"device {workload.device!r}: a plan is for GPUs (a CPU workload is the "
                                       f"memory check's, `memory.compare`); plan device='cuda'.")
    require(workload.path != TE_LAYERS or gpu.transformer_engine,
            f"the {gpu.name} cannot run Transformer Engine's layers ({gpu.limits}); plan layers='{LOCAL_LAYERS}'.")
    with states.memoized():
        options = [evaluate(model, layout, workload, cluster, overhead_gib)
                   for layout in valid_layouts(model, workload, cluster.world_size, cluster.gpus_per_node,
                                               micro_batch_sizes)]
    require(options, f"no layout of {cluster.world_size} GPUs takes a global batch of {workload.global_batch_size} "
                     f"sequences of {workload.seq_length}: every layout needs the global batch divisible by micro-batch "
                     f"x data-parallel size (micro-batches {list(micro_batch_sizes)}), and the world divisible by "
                     f"TP x PP x CP. Give a global batch that is a multiple of the GPU count, or another GPU count.")
    return sorted(options, key=lambda o: (not o.fits, -o.time.tokens_per_s if o.fits else o.memory.total))


TIED_WITHIN = 0.02
"""Layouts whose predicted tokens/s are within this fraction of the fastest one's are a tie: the step time reproduced
its calibrating run within 1%, and adds communication and the pipeline bubble from datasheet link speeds at an assumed
efficiency, with no overlap (docs/planning.md); differences of about twice that are not ones it can rank."""


def choose(options: list[Option], tied_within: float = TIED_WITHIN) -> Option | None:
    """The layout to run: among the fitting layouts without CP (the trainer has none yet) whose predicted speed is
    within `tied_within` of the fastest of them, the one with the most memory free (the overhead and the allocator's
    fragmentation are assumed, not measured: headroom is what absorbs them), the faster on equal memory. None where no
    layout without CP fits."""
    runnable = [o for o in options if o.fits and o.layout.cp == 1]
    if not runnable:
        return None
    fastest = max(o.time.tokens_per_s for o in runnable)
    tied = [o for o in runnable if o.time.tokens_per_s >= fastest * (1 - tied_within)]
    return min(tied, key=lambda o: (o.memory.total, -o.time.tokens_per_s))


def tied_with_fastest(options: list[Option], tied_within: float = TIED_WITHIN) -> list[Option]:
    """The fitting layouts (CP or not) within `tied_within` of the fastest one's predicted speed, fastest first."""
    fitting = [o for o in options if o.fits]
    return [o for o in fitting if o.time.tokens_per_s >= fitting[0].time.tokens_per_s * (1 - tied_within)]


MEMORY_COLUMNS = ("weights", "gradients", "optimizer", "activations", "transient", "overhead", "total")
TIME_COLUMNS = ("compute", "recompute", "moe_imbalance", "tp", "cp", "ep", "pp_bubble", "pp_p2p", "dp", "total")


def table(options: list[Option], tokens: float | None = None, top: int = 10) -> str:
    """A text table of the first `top` options: memory terms in GiB, time terms in ms, tokens/s, and days for
    `tokens`."""
    head = (["layout"] + [f"{c[:5]} GiB" for c in MEMORY_COLUMNS] + [f"{c[:6]} ms" for c in TIME_COLUMNS]
            + ["tok/s/GPU", "tokens/s"] + (["days"] if tokens else []))
    rows = [head]
    for o in options[:top]:
        mem = o.memory.terms()
        times = o.time.terms()
        # a CP layout is for Megatron-LM or NeMo with Transformer Engine: the cookbook's trainer has no CP
        row = [o.layout.describe() + ("" if o.fits else " (does not fit)")
               + (" [CP: TE, Megatron-LM/NeMo]" if o.layout.cp > 1 else "")]
        row += [f"{mem[c] / GIB:.1f}" for c in MEMORY_COLUMNS] + [f"{times[c] * 1e3:.0f}" for c in TIME_COLUMNS]
        row += [f"{o.time.tokens_per_s / o.world:,.0f}", f"{o.time.tokens_per_s:,.0f}"]
        row += [f"{o.time.days(tokens):.1f}"] if tokens else []
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                     for r in rows)
