"""A training layout as a plan sees it (`Layout`), what it trains on (`Workload`), and every valid layout of a model on
a cluster (`valid_layouts`), valid by the cookbook's own rules: `RunConfig.validate` (`core.configs.layout.check` and the batch
rules), never a second copy of them.

The layer path (`Workload.layers`) is the one a run decides (`core.machine.build`): Transformer Engine's spec where TE
is installed (NGC and PAI images; the plan's default), Megatron-Core's local spec otherwise, and always with LoRA (the
adapters wrap the local spec's linears); on a CPU the local spec or the CPU path (`local+cpu`), which only the memory
check plans (`Workload.device="cpu"`). Path and device decide what each layer saves (`plan.activations`).

Context parallelism (CP) is a planner dimension only, on the Transformer Engine path: Megatron-Core's local attention
refuses it, and the cookbook's `ParallelConfig` has no CP yet (a CP layout is one for Megatron-LM or NeMo). A layout
with CP is checked as the same layout on world / CP processes, plus Megatron-Core's own CP rule (the sequence splits
into 2 x CP chunks for load balance).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pai_cookbook.core.configs.config import (
    ConfigError,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
)
from pai_cookbook.core.configs.layout import divisors
from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.model_config import require
from pai_cookbook.core.machine.build import CPU_LAYERS, LAYER_PATHS, LOCAL_LAYERS, TE_LAYERS, without_te

Recompute = Literal["selective", "full"] | None
RECOMPUTES: tuple[Recompute, ...] = (None, "selective", "full")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one training run is split and what it trades for memory. DP is what the world leaves."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert TP; None: the same as TP."""
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    recompute: Recompute = None
    """None, "selective" (core attention), "full" (uniform, `recompute_num_layers` layers per checkpoint)."""
    recompute_num_layers: int = 1
    distributed_optimizer: bool = False

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                              virtual_pipeline_model_parallel_size=self.vpp, expert_model_parallel_size=self.ep,
                              expert_tensor_parallel_size=self.etp, sequence_parallel=self.sequence_parallel)

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp * self.cp)

    def expert_dp(self, world: int) -> int:
        """Ranks an expert's gradients are reduced over: world / (PP x EP x expert-TP)."""
        return world // (self.pp * self.ep * (self.etp or self.tp))

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"VPP{self.vpp}"] if self.vpp else [])
        parts += [f"CP{self.cp}"] * (self.cp > 1) + [f"EP{self.ep}"] * (self.ep > 1)
        parts += [f"ETP{self.etp}"] * (self.etp is not None and self.etp != self.tp) + ["SP"] * self.sequence_parallel
        parts += [f"mbs{self.micro_batch_size}", self.recompute or "no-recompute",
                  "distopt" if self.distributed_optimizer else "adam"]
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a step trains on, and in which precision."""

    seq_length: int
    global_batch_size: int
    dtype: Literal["bf16", "fp32"] = "bf16"
    lora: LoRAConfig | None = None
    """LoRA adapters on the frozen model (`RunConfig.lora`): only they have gradients and optimizer state."""
    layers: str = TE_LAYERS
    """The layer path (`core.machine.build`): Transformer Engine's spec (a GPU image with TE, the default), the local
    spec (a GPU without TE, and what the cookbook's memory check measures on the CPU with `PAI_COOKBOOK_LAYERS=local`),
    or the CPU path (`local+cpu`, the local spec with the CPU converters: what a CPU run builds by default)."""
    grad_reduce_in_fp32: bool = True
    """DDP's gradient buffer in fp32 (the cookbook's worker, NeMo's and Megatron-LM's bf16 recipes); False: in the
    weights' dtype."""
    moe_imbalance: float = 1.0
    """The most loaded expert-parallel rank's routed tokens over the mean (1.0: balanced routing); `moe.ep_imbalance`
    measures it from a run's router statistics (notebook 05's). It scales that rank's expert activations, expert
    compute and all-to-all traffic."""
    device: Literal["cuda", "cpu"] = "cuda"
    """Where the layers run: a GPU (every plan), or a CPU (the cookbook's memory check, `memory.compare`). It matters to
    the local spec's RMSNorm, which torch runs as one fused kernel on CUDA and decomposed, with fp32 copies, on a CPU."""

    def __post_init__(self) -> None:
        for name in ("seq_length", "global_batch_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"{name} {value!r} must be a whole number >= 1 (tokens per sequence; sequences per step).")
        require(self.dtype in ("bf16", "fp32"), f"dtype {self.dtype!r}: the plan models 'bf16' and 'fp32'.")
        require(isinstance(self.moe_imbalance, (int, float)) and math.isfinite(self.moe_imbalance)
                and self.moe_imbalance >= 1.0,
                f"moe_imbalance {self.moe_imbalance!r} must be >= 1.0 (the most loaded rank's tokens over the mean).")
        require(self.layers in LAYER_PATHS, f"layers {self.layers!r}: the plan models {list(LAYER_PATHS)}.")
        require(self.device in ("cuda", "cpu"), f"device {self.device!r}: 'cuda' or 'cpu'.")
        require(self.device == "cpu" or self.layers != CPU_LAYERS,
                f"layers {CPU_LAYERS!r} is what a CPU run builds; on a GPU the layers are {TE_LAYERS!r} or "
                f"{LOCAL_LAYERS!r}.")
        require(self.device == "cuda" or self.layers != TE_LAYERS,
                f"layers {TE_LAYERS!r} run on CUDA only; a CPU builds {LOCAL_LAYERS!r} or {CPU_LAYERS!r}.")

    @property
    def path(self) -> str:
        """The layers a run of this workload builds: with LoRA not Transformer Engine's (its adapters wrap the local
        linears: `LoRAConfig.narrow_layers`), else `layers`."""
        return without_te(self.layers) if self.lora is not None else self.layers

    def micro_batches(self, layout: Layout, world: int) -> int:
        """Micro-batches per step on one data-parallel rank: global / (micro x DP)."""
        return self.global_batch_size // (layout.micro_batch_size * layout.dp(world))


def run_config(model: ModelConfig, layout: Layout, workload: Workload) -> RunConfig:
    """The cookbook's `RunConfig` of this layout (without CP, which it does not have)."""
    memory = MemoryConfig(recompute_granularity=layout.recompute, recompute_num_layers=layout.recompute_num_layers)
    return RunConfig(model=model, parallel=layout.parallel(), memory=memory,
                     precision=PrecisionConfig(dtype=workload.dtype),
                     optimizer=OptimizerConfig(use_distributed_optimizer=layout.distributed_optimizer),
                     data=DataConfig(seq_length=workload.seq_length, micro_batch_size=layout.micro_batch_size,
                                     global_batch_size=workload.global_batch_size))


def from_run_config(config: RunConfig, layers: str = LOCAL_LAYERS, device: str = "cpu") -> tuple[Layout, Workload]:
    """The layout and workload of a cookbook `RunConfig` (what a training run measured with `measure_memory` ran) on
    the layer path `layers` (the run's `result["layers"]["layers"]`) and `device` ("cuda" or "cpu")."""
    p, m = config.parallel, config.memory
    require(m.recompute_granularity != "selective" or m.recompute_modules == ["core_attn"],
            f"the plan models selective recompute of core_attn only, got {m.recompute_modules}.")
    require(m.recompute_granularity != "full" or m.recompute_method == "uniform",
            "the plan models uniform full recompute only; set recompute_method='uniform'.")
    layout = Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                    vpp=p.virtual_pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                    etp=p.expert_tensor_parallel_size, sequence_parallel=p.sequence_parallel,
                    micro_batch_size=config.data.micro_batch_size, recompute=m.recompute_granularity,
                    recompute_num_layers=m.recompute_num_layers,
                    distributed_optimizer=config.optimizer.use_distributed_optimizer)
    require(config.precision.dtype in ("bf16", "fp32"), f"the plan models bf16 and fp32, got {config.precision.dtype}.")
    return layout, Workload(seq_length=config.data.seq_length, global_batch_size=config.data.global_batch_size,
                            dtype=config.precision.dtype, lora=config.lora, layers=layers, device=device)


def check(model: ModelConfig, layout: Layout, workload: Workload, world: int) -> None:
    """Refuse a layout the cookbook would refuse (`RunConfig.validate` on world / CP), or that CP cannot split.

    Raises:
        ConfigError: naming the offending value and the fix.
    """
    require(not model.post_norms,
            f"{model.family}: the plan does not model Gemma's norms yet (four a layer, each computed in fp32, "
            f"whose activations it would leave out: 25% of a tiny Gemma 3's under full recompute); plan a Llama of the "
            f"same shape for a first estimate, and measure the run (RunConfig(measure_memory=True)).")
    require(not model.norm_plus_one or workload.path == TE_LAYERS,
            f"{model.family}: (1 + w) norms on Megatron-Core's local layers are computed in fp32 "
            f"(core.modeling.gemma.PlusOneRMSNorm), which the plan does not model; plan on Transformer Engine's layers "
            f"(their zero-centered norms are the plan's one fused norm).")
    require(not model.attention_sinks or workload.path == TE_LAYERS,
            f"{model.family}: attention sinks on Megatron-Core's local layers materialise every head's scores "
            f"(core.modeling.attention.sink_attention), which the plan does not model; plan on Transformer Engine's "
            f"layers (2.8 and later compute sinks in their fused attention).")
    require(world % layout.cp == 0, f"world size {world} is not divisible by CP={layout.cp}.")
    require(layout.cp == 1 or workload.path == TE_LAYERS,
            f"CP={layout.cp} needs Transformer Engine's attention; Megatron-Core's local spec refuses it"
            + (" (and LoRA builds the local spec)" if workload.lora is not None else "") + ".")
    require(layout.cp == 1 or workload.seq_length % (2 * layout.cp) == 0,
            f"seq_length {workload.seq_length} is not divisible by 2 x CP = {2 * layout.cp} (Megatron-Core splits the "
            f"sequence into 2 x CP chunks for load balance).")
    require(layout.recompute != "full" or (model.num_layers // (layout.pp * (layout.vpp or 1)))
            % layout.recompute_num_layers == 0,
            f"recompute_num_layers {layout.recompute_num_layers} does not divide the layers of a pipeline chunk.")
    run_config(model, layout, workload).validate(world // layout.cp)


def valid_layouts(model: ModelConfig, workload: Workload, world: int, gpus_per_node: int,
                  micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> Iterator[Layout]:
    """Every layout of `model` on `world` GPUs the cookbook accepts: TP within a node, PP over divisors of the layers
    (interleaved with every number of chunks per stage that divides its layers), CP up to a node on the Transformer
    Engine path, EP over divisors of the experts with expert-TP equal to TP or 1, sequence parallelism on and off at
    TP > 1, each micro-batch size, each recompute, with and without the distributed optimizer."""
    tps = [t for t in divisors(gpus_per_node) if t <= world]
    cps = tps if workload.path == TE_LAYERS else [1]
    experts = divisors(model.num_experts) if model.is_moe else [1]
    for tp, pp, cp, ep in ((t, p, c, e) for t in tps for p in divisors(model.num_layers) for c in cps
                           for e in experts):
        if tp * pp * cp > world or world % (tp * pp * cp):
            continue
        chunks = [v for v in divisors(model.num_layers // pp) if v > 1] if pp > 1 else []
        for vpp in [None] + chunks:
            etps = (None, 1) if model.is_moe and tp > 1 else (None,)
            for sp, mbs, recompute, distopt, etp in ((s, b, r, d, x) for s in ((False, True) if tp > 1 else (False,))
                                                     for b in micro_batch_sizes for r in RECOMPUTES
                                                     for d in (False, True) for x in etps):
                layout = Layout(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp,
                                micro_batch_size=mbs, recompute=recompute, distributed_optimizer=distopt)
                try:
                    check(model, layout, workload, world)
                except ConfigError:
                    continue
                yield layout
