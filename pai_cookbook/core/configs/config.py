"""Run configuration: one dataclass per concern, validated before any worker starts.

Every field that the seed project's launch scripts took as a positional shell argument is a named,
documented field here. `RunConfig` bundles the concerns, travels to the workers as JSON
(`to_json` / `from_json`), and `RunConfig.validate(world_size, device)` checks the cross-field rules
(parallel layout against model shape and world size, precision against the hardware) so that a bad
layout fails in the notebook cell, with the fix, and not minutes later inside rank 3's log.
The model's own architecture, `ModelConfig`, lives in `core.configs.model_config` and is re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.layout import ParallelConfig
from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.model_config import ConfigError, ModelConfig, positive, require
from pai_cookbook.core.launching.job import Job
from pai_cookbook.core.machine import build

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "FP8Config", "MemoryConfig", "ModelConfig", "OptimizerConfig",
           "ParallelConfig", "PrecisionConfig", "RunConfig", "with_token_budget"]

DType = Literal["fp32", "bf16", "fp16"]
FP8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]


MAX_AMAX_HISTORY = 8192
"""The longest amax history FP8Config accepts (Transformer Engine's default: 1024)."""
MAX_FP8_MARGIN = 1023
"""2**margin is a float up to here (2**1024 overflows in the worker). Margins that leave the scale 0 in fp32 (above
~150) pass this check and fail at their first step: the non-finite guard stops the run there and names FP8."""


@dataclass(kw_only=True)
class FP8Config:
    """FP8 GEMMs: the seed's `--fp8-hybrid --fp8-amax-compute-algo max --fp8-amax-history-len 1024` map one to
    one onto `FP8Config(format="hybrid", amax_compute_algo="max", amax_history_len=1024)`.

    Embedding and output layer always stay in the higher precision (as in Megatron-Core).
    """

    recipe: FP8Recipe = "delayed"
    """delayed (amax history), tensorwise (current scaling), blockwise (1x128 / 128x128 blocks), mxfp8 (Blackwell)."""
    format: Literal["hybrid", "e4m3"] = "hybrid"
    """hybrid: e4m3 forward, e5m2 gradients (the usual choice); e4m3: e4m3 everywhere."""
    amax_history_len: int = 1024
    """delayed: steps of amax history a scale is computed from."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """delayed: the history's maximum or its most recent entry."""
    margin: int = 0
    """delayed and tensorwise: the scale is divided by 2**margin (headroom against growing values)."""
    first_last_layers_bf16: bool = False
    """Keep the first and last transformer layers out of FP8 (not with delayed scaling, as in Megatron-Core)."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    wgrad: bool = True
    """FP8 weight-gradient GEMM; False computes it in the higher precision (Transformer Engine only)."""
    backend: Literal["auto", "te", "emulated"] = "auto"
    """auto: Transformer Engine on a GPU of compute capability >= 8.9 with TE importable, else emulated
    (core/modeling/fp8.py: FP8 rounding and range by quantize/dequantize, GEMMs in fp32; labelled so in every report)."""

    def __post_init__(self) -> None:
        require(self.recipe in typing.get_args(FP8Recipe),
                 f"fp8 recipe {self.recipe!r} is not one of {typing.get_args(FP8Recipe)}.")
        require(self.format in ("hybrid", "e4m3"), f"fp8 format {self.format!r} is not 'hybrid' or 'e4m3'.")
        require(self.amax_compute_algo in ("max", "most_recent"),
                 f"amax_compute_algo {self.amax_compute_algo!r} is not 'max' or 'most_recent'.")
        require(self.backend in ("auto", "te", "emulated"), f"fp8 backend {self.backend!r} is not auto, te or emulated.")
        positive(self, "amax_history_len")
        # the history is one float per step for every FP8 operand of every linear layer, kept on the device
        mib = self.amax_history_len * 4 / 2**20
        require(self.amax_history_len <= MAX_AMAX_HISTORY,
                 f"amax_history_len {self.amax_history_len} keeps that many floats per FP8 operand (~{mib:,.0f} MiB "
                 f"each); use at most {MAX_AMAX_HISTORY} (Transformer Engine's default is 1024).")
        require(0 <= self.margin <= MAX_FP8_MARGIN,
                 f"margin {self.margin} must lie in [0, {MAX_FP8_MARGIN}]: the scale is divided by 2**margin, which "
                 f"overflows beyond that (typical margins are 0 to 2).")
        require(self.num_layers_at_start_in_bf16 >= 0 and self.num_layers_at_end_in_bf16 >= 0,
                 f"num_layers_at_start_in_bf16 {self.num_layers_at_start_in_bf16} and num_layers_at_end_in_bf16 "
                 f"{self.num_layers_at_end_in_bf16} count layers kept in bf16; they must be >= 0.")
        require(not (self.first_last_layers_bf16 and self.recipe == "delayed"),
                 "first_last_layers_bf16 cannot be combined with delayed scaling (Megatron-Core refuses it too); "
                 "use recipe='tensorwise' or 'blockwise', or first_last_layers_bf16=False.")

    def resolve_backend(self, device: Any) -> str:
        """'te' or 'emulated' on `device` (a runtime.DeviceInfo), or ConfigError saying why neither can run: the build
        plan's decision (`core.machine.build.fp8_backend`)."""
        return build.fp8_backend(device, self.recipe, self.backend, self.wgrad)

    def decided(self, device: Any) -> FP8Config:
        """This config with `backend` decided on `device` (`resolve_backend`): what the launcher writes into the job
        (`core.launching.job.decided`), so that every worker reads one answer (`decided_backend`)."""
        return dataclasses.replace(self, backend=self.resolve_backend(device))

    def narrow_layers(self, layers: str) -> str:
        """The layers this FP8 builds where the machine's are `layers`: emulated FP8's linears are the local spec's
        (`core.machine.build.without_te`; `core.launching.job.decided` calls it on the decided config)."""
        return build.without_te(layers) if self.backend == "emulated" else layers

    @property
    def decided_backend(self) -> str:
        """'te' or 'emulated', as the launcher decided it; a config still on 'auto' never reached a worker through the
        launcher, and is refused here rather than decided a second time."""
        if self.backend == "auto":
            raise ValueError("FP8Config.backend is still 'auto': the launcher decides it into the job "
                             "(core.launching.job.decided(job, device)); build the model from the decided job.")
        return self.backend


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numeric formats for parameters, activations and GEMMs."""

    dtype: DType = "fp32"
    """Parameter and activation dtype; bf16 keeps fp32 master weights in the optimizer."""
    fp8: FP8Config | None = None
    """FP8 GEMMs (FP8Config); None disables FP8."""

    def __post_init__(self) -> None:
        require(self.dtype in typing.get_args(DType),
                 f"dtype {self.dtype!r} is not one of {typing.get_args(DType)}.")
        require(self.fp8 is None or isinstance(self.fp8, FP8Config),
                 f"fp8 must be an FP8Config (e.g. FP8Config(recipe='delayed')) or None, got {self.fp8!r}.")
        # bf16 is the usual partner; fp32 isolates FP8's own effect (no bf16 rounding elsewhere): both run
        require(self.fp8 is None or self.dtype in ("bf16", "fp32"),
                 f"fp8 runs the non-GEMM parts in bf16 (or fp32); set dtype='bf16' (got {self.dtype!r}).")


RecomputeModule = Literal["core_attn", "layernorm", "mlp", "moe_act", "moe", "shared_experts"]


@dataclass(kw_only=True)
class MemoryConfig:
    """Activation recomputation: trade compute for activation memory."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """'full': recompute whole layers in backward; 'selective': only `recompute_modules`; None: off."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """With 'full': checkpoint groups of `recompute_num_layers` (uniform) or the first N layers (block)."""
    recompute_num_layers: int = 1
    recompute_modules: list[RecomputeModule] = field(default_factory=lambda: ["core_attn"])
    """With 'selective': which submodules' activations are recomputed (core_attn is the cheap classic)."""

    def __post_init__(self) -> None:
        positive(self, "recompute_num_layers")
        known = typing.get_args(RecomputeModule)
        bad = [m for m in self.recompute_modules if m not in known]
        require(not bad, f"recompute_modules {bad} are not among {known}.")


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW with warmup and decay to a minimum learning rate."""

    lr: float = 3e-4
    """Peak learning rate after warmup."""
    min_lr: float = 3e-5
    """Floor the schedule decays to."""
    lr_warmup_iters: int = 0
    """Linear warmup steps from 0 to lr."""
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    def __post_init__(self) -> None:
        positive(self, "lr")
        require(0 <= self.min_lr <= self.lr,
                 f"min_lr {self.min_lr} must lie in [0, lr={self.lr}]; the schedule decays from lr to min_lr.")
        require(self.lr_warmup_iters >= 0, f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}.")


@dataclass(kw_only=True)
class DataConfig:
    """What each step reads."""

    seq_length: int = 128
    """Tokens per sample."""
    micro_batch_size: int = 2
    """Samples per forward/backward on one data-parallel rank."""
    global_batch_size: int = 8
    """Samples per optimizer step over all DP ranks; accumulation = global / (micro x DP)."""
    source: Literal["synthetic", "indexed", "sft"] = "synthetic"
    """'indexed': Megatron-Core GPT datasets made by `data.prepare` (`paths`); 'sft': conversations made
    by `sft.prepare` (one folder in `paths`: packed rows, answer-only loss masks, epochs reshuffled);
    'synthetic': seeded arithmetic progressions (learnable), the same on every layout, for smoke tests and
    parity checks."""
    paths: list[str] = field(default_factory=list)
    """Dataset prefixes written by `data.prepare` (without .bin/.idx), with source='indexed'; the folder
    written by `sft.prepare`, with source='sft'."""
    loss_average: Literal["token", "sample"] = "token"
    """The loss of a global batch: the mean over all its loss tokens ('token', Megatron-Core's per-token
    loss), or the mean over its samples of each sample's mean ('sample': a short answer weighs as much as
    a long one). Either is the same for any micro-batch split and DP size."""
    weights: list[float] | None = None
    """Blend weights, one per path (normalised by Megatron-Core); None blends by size."""
    split: str = "98,2,0"
    """Train, validation and test percentages of every dataset."""

    def __post_init__(self) -> None:
        positive(self, "seq_length", "micro_batch_size", "global_batch_size")
        require(self.source != "indexed" or self.paths,
                 "source='indexed' needs paths: the dataset prefixes written by data.prepare(...).")
        require(self.source != "sft" or len(self.paths) == 1,
                 f"source='sft' needs paths=[one folder written by sft.prepare(...)], got {self.paths}.")
        require(self.loss_average in ("token", "sample"),
                 f"loss_average={self.loss_average!r}; use 'token' or 'sample'.")
        require(self.weights is None or len(self.weights) == len(self.paths),
                 f"weights has {len(self.weights or [])} entries for {len(self.paths)} paths; give one per path.")
        parts = self.split.split(",")
        require(len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts),
                 f"split {self.split!r} must be three comma-separated numbers: train,valid,test (e.g. '98,2,0').")
        require(sum(float(p) for p in parts) > 0,
                 f"split {self.split!r} gives every part weight 0; give positive weights such as '98,2,0'.")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where training starts from and where it saves (Megatron-Core torch_dist checkpoints)."""

    load_dir: str | None = None
    """Weights to start from: a converted (`convert.hf_to_megatron`) or trained checkpoint; None: from scratch."""
    save_dir: str | None = None
    """Folder of this run's checkpoints (save_dir/iter_NNNNNNN); None skips saving."""
    save_interval: int = 0
    """Steps between saves; 0 saves only at the end."""
    keep_last: int = 2
    """Checkpoints kept in save_dir; older ones are deleted after each save."""
    resume: bool = True
    """Continue from the latest checkpoint in save_dir (model, optimizer, schedule, data position, RNG)."""
    overwrite: bool = False
    """With resume=False: delete what save_dir holds and start over, instead of refusing."""

    def __post_init__(self) -> None:
        require(self.save_interval >= 0, f"save_interval must be >= 0, got {self.save_interval}.")
        positive(self, "keep_last")


@dataclass(kw_only=True)
class RunConfig(Job):
    """Everything one training run needs: the training worker's job, JSON for the torchrun workers."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.train"
    SPANS_NODES: ClassVar[bool] = True
    REPEATED_STEPS: ClassVar[bool] = True

    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train_iters: int = 10
    """Optimizer steps."""
    seed: int = 1234
    """Seeds weights (same on every layout: weights are initialised whole, then split) and data."""
    log_interval: int = 1
    """Steps between progress reports."""
    eval_interval: int = 0
    """Steps between validation-loss evaluations (and one at the end); 0 disables validation."""
    eval_iters: int = 2
    """Global batches of the validation split per evaluation."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the frozen model of `checkpoint.load_dir` instead of every weight
    (`core.modeling.lora`); its checkpoints then hold the adapters alone."""
    measure_memory: bool = False
    """Count what each rank holds (`core.measures.memory_probe`): weights, gradient buffers, optimizer state, peak saved
    activations; every rank's figures come back in the result's "memory"."""

    def __post_init__(self) -> None:
        positive(self, "train_iters", "log_interval", "eval_iters")
        require(self.optimizer.lr_warmup_iters < self.train_iters,
                 f"lr_warmup_iters {self.optimizer.lr_warmup_iters} must be below train_iters {self.train_iters} "
                 f"(the cosine decay runs from the end of warmup to the last step); shorten the warmup.")
        require(self.memory.recompute_granularity != "full" or
                 self.model.num_layers % self.memory.recompute_num_layers == 0 or
                 self.memory.recompute_method == "block",
                 f"uniform full recompute groups layers by recompute_num_layers "
                 f"{self.memory.recompute_num_layers}, which does not divide num_layers {self.model.num_layers}.")
        require(self.lora is None or self.checkpoint.load_dir,
                 "LoRA adapts a trained model: set checkpoint.load_dir to its checkpoint (adapters on random weights "
                 "learn what full training would, slower).")
        if self.lora is not None:
            self.lora.check(self.model)
        require(self.data.seq_length <= self.model.max_position_embeddings,
                 f"seq_length {self.data.seq_length} exceeds the model's max_position_embeddings "
                 f"{self.model.max_position_embeddings}; shorten seq_length.")

    @classmethod
    def from_checkpoint(cls, start: str | Path, *, save_dir: str | Path | None = None, save_interval: int = 0,
                        overwrite: bool = False, **fields: Any) -> RunConfig:
        """The run that trains on from the checkpoint `start` (a reward model's base, GRPO/PPO's policy and critic, any
        continued training): its model and precision are the checkpoint's own
        (`core.checkpoints.checkpoint_config.read_config`), `fields` set the rest (optimizer, data, train_iters, seed,
        parallel, ...); a re-run into `save_dir` resumes unless `overwrite`."""
        from pai_cookbook.core.checkpoints.checkpoint_config import DTYPE_NAMES, read_config, resolve

        start = resolve(start)  # a save folder: its latest finished iteration
        model, dtype = read_config(start)
        return cls(model=model, precision=PrecisionConfig(dtype=DTYPE_NAMES[dtype]), **fields,
                   checkpoint=CheckpointConfig(load_dir=str(start), save_dir=str(save_dir) if save_dir else None,
                                               save_interval=save_interval, overwrite=overwrite, resume=not overwrite))

    def validate(self, world_size: int, device: Any = None) -> None:
        """Check the layout against the model and the world size (`layout.check`), the batch against the
        layout, and precision against the device.

        Args:
            world_size: total processes (nodes x processes per node).
            device: a `runtime.DeviceInfo`; None skips the hardware checks.
        Raises:
            ConfigError: naming the offending value and the fix.
        """
        p = self.parallel
        pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
        dp = layout.check(self.model, p, world_size, purpose="train", device=device)
        micro_x_dp = self.data.micro_batch_size * dp
        require(self.data.global_batch_size % micro_x_dp == 0,
                 f"global_batch_size {self.data.global_batch_size} is not divisible by micro_batch_size x DP = "
                 f"{self.data.micro_batch_size} x {dp} = {micro_x_dp}; use a multiple of {micro_x_dp}.")
        if vpp is not None:
            micro_batches = self.data.global_batch_size // micro_x_dp
            require(micro_batches % pp == 0,
                     f"the interleaved schedule needs micro-batches per step ({micro_batches}) divisible by "
                     f"PP={pp}; raise global_batch_size to a multiple of {micro_x_dp * pp}.")
        if device is not None:
            if self.precision.fp8 is not None:
                self.precision.fp8.resolve_backend(device)
            require(self.precision.dtype != "fp16" or device.is_cuda,
                     "dtype='fp16' needs a GPU (CPU kernels lack half-precision GEMMs); use 'bf16' or 'fp32'.")
            # packed SFT rows on the TE spec are THD sequences, which TE attends in bf16/fp16 only (its
            # unfused fp32 attention takes no THD input)
            require(not (self.data.source == "sft" and device.transformer_engine and self.precision.dtype == "fp32"),
                     "SFT rows on a GPU with Transformer Engine go through its packed-sequence (THD) attention, "
                     "which has no fp32 kernel; use PrecisionConfig(dtype='bf16').")
        fp8 = self.precision.fp8
        if fp8 is not None and fp8.first_last_layers_bf16:
            kept = fp8.num_layers_at_start_in_bf16 + fp8.num_layers_at_end_in_bf16
            require(kept < self.model.num_layers,
                     f"first_last_layers_bf16 keeps {kept} of the model's {self.model.num_layers} layers in BF16: none "
                     f"would run in FP8; lower num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16.")

    def check(self, world_size: int, device: Any) -> None:
        self.validate(world_size, device)


def with_token_budget(config: RunConfig, train_tokens: int, warmup_tokens: int = 0) -> RunConfig:
    """The seed project's schedule in tokens: steps = tokens / (global batch x sequence length).

    E.g. 1e9 train tokens at 256 x 4096 = 1,048,576 tokens per step -> 954 steps (rounded up).
    """
    per_step = config.data.global_batch_size * config.data.seq_length
    require(train_tokens >= per_step, f"train_tokens {train_tokens} is less than one step of {per_step} tokens "
                                       f"(global_batch_size x seq_length); raise it or shrink the batch.")
    require(0 <= warmup_tokens <= train_tokens, f"warmup_tokens {warmup_tokens} must lie in [0, train_tokens].")
    optimizer = dataclasses.replace(config.optimizer, lr_warmup_iters=round(warmup_tokens / per_step))
    return dataclasses.replace(config, train_iters=math.ceil(train_tokens / per_step), optimizer=optimizer)
