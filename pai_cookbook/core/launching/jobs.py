"""Every worker's job but the training run's: the typed contract between a recipe and its worker.

A recipe checks its inputs, builds one of these and hands it to `core.launching.launch`; the worker named by its `WORKER`
reads it back from job.json (`core.launching.job.from_dict`, which checks every field's type). The training run's job,
`RunConfig`, is in `core.configs.config`; the knobs a job carries are in their own modules (`core.configs.generation`,
`core.configs.rlhf_config`). The recipes export each job under its old name (`convert.ConvertJob`, `rlhf.RLJob`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ConfigError, ModelConfig, ParallelConfig, PrecisionConfig, RunConfig
from pai_cookbook.core.configs.generation import GenerationConfig
from pai_cookbook.core.configs.rlhf_config import DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig
from pai_cookbook.core.launching.job import Job
from pai_cookbook.core.measures.logit_parity import DEFAULT_BATCH, DEFAULT_SEQ

DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default shard size: 5 GB
DIRECTIONS = ("hf2mcore", "mcore2hf", "reshard", "lora_merge", "lora_peft")
INITS = ("mean", "hf_mean", "random")
"""New rows: mean of the sub-token rows; transformers' `resize_token_embeddings(mean_resizing=True)`
(a sample of N(mean of all rows, 1e-9 x their covariance)); N(0, init_method_std), as a fresh model."""


@dataclass(kw_only=True)
class ConvertJob(Job):
    """The conversion worker's job: one direction, a source, a destination (a `.partial` folder for
    the streaming directions), and the layout for `reshard`."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.convert"

    direction: Literal["hf2mcore", "mcore2hf", "reshard", "lora_merge", "lora_peft"]
    src: str
    dst: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout the `reshard` direction loads and saves at (the streaming directions run on one process)."""
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    """mcore2hf: the largest safetensors shard."""
    model: ModelConfig | None = None
    """hf2mcore: the source's config as `inspect_hf` read it before launch."""
    drop_mtp: bool = False
    """hf2mcore: convert without the source's multi-token-prediction layers (`hf_checkpoint.inspect_hf`)."""

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"direction {self.direction!r} is not one of {DIRECTIONS}.")

    def processes(self) -> int:
        return layout.world_size(self.parallel) if self.direction in ("reshard", "lora_merge") else 1


@dataclass(kw_only=True)
class GenerationJob:
    """One checkpoint, its tokenized prompts, a decoding config and a layout: a unit of one launch."""

    ckpt: str
    """Cookbook checkpoint folder (resolved)."""
    prompt_ids: list[list[int]]
    """Tokenized prompts, in output order."""
    config: GenerationConfig = field(default_factory=GenerationConfig)
    """How to decode."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout to load the checkpoint at."""
    label: str = ""
    """Name reported with the job's result."""
    eos_ids: list[int] = field(default_factory=list)
    """End-of-sequence ids: the checkpoint's own, then the config's `eos_token_ids`."""
    max_sequence: int = 0
    """Longest prompt + max_new_tokens: what the KV cache is sized for."""


@dataclass(kw_only=True)
class GenerationBatch(Job):
    """The generation worker's job: several `GenerationJob`s run in one launch."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.generate"

    jobs: list[GenerationJob]


@dataclass(kw_only=True)
class GrowJob(Job):
    """The growth worker's job: a checkpoint, the larger vocabulary, the new rows' initialisation."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.grow"

    src: str
    dst: str
    assets: str
    """Folder with the new tokenizer files and the updated config.json (saved as the new hf_assets/)."""
    vocab_size: int
    sources: list[list[int]]
    init: str = "mean"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ConfigError(f"init {self.init!r} is not one of {INITS}.")


@dataclass(kw_only=True)
class ScoreJob(Job):
    """The scoring worker's job: checkpoints, named text sets, and (base, extended, text set) pairs."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.score"

    checkpoints: list[str]
    texts: dict[str, list[str]]
    pairs: list[list[str]] = field(default_factory=list)
    batch: int = 8


@dataclass(kw_only=True)
class EvalJob(Job):
    """The evaluation worker's job: a checkpoint at a layout, and token sequences whose last tokens are scored (a
    continuation after its context, or a window of a rolling perplexity). Each sequence is fed without its last token,
    and the log-probability of each of its last `scored` tokens is taken from the position before it."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.evaluate"

    ckpt: str
    sequences: list[list[int]]
    """Context + continuation ids, at most the model's positions + 1 long (`evaluate` truncates on the left)."""
    scored: list[int]
    """How many final tokens of each sequence are scored (>= 1)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    batch: int = 8
    """Sequences per forward pass (sorted by length, so little of a batch is padding)."""

    def processes(self) -> int:
        return layout.world_size(self.parallel)


@dataclass(kw_only=True)
class UpcycleJob(Job):
    """The upcycling worker's job: a dense checkpoint, the MoE model to build from it, and the layout."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.upcycle"

    src: str
    """Dense cookbook checkpoint."""
    out: str
    """MoE checkpoint to write (atomically, by `checkpoint.save`)."""
    model: ModelConfig
    """The MoE model (`upcycled_config` of the dense one)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 1234
    """Seeds the router weights (the only new weights)."""


@dataclass(kw_only=True)
class Sweep(Job):
    """Several training runs, one after another in one launch: the job of `sweep`."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.sweep"
    SPANS_NODES: ClassVar[bool] = True
    REPEATED_STEPS: ClassVar[bool] = True

    names: list[str]
    folders: list[str]
    """Each run's folder under the launch's run folder (its metrics.jsonl, TensorBoard)."""
    runs: list[RunConfig]

    def check(self, world_size: int, device: Any) -> None:
        for config in self.runs:
            config.validate(world_size, device)


@dataclass(kw_only=True)
class ParityJob(Job):
    """The parity worker's job: one checkpoint, its Hugging Face twin, and the layouts to load it at."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.parity"

    hf_dir: str
    ckpt: str
    layouts: list[ParallelConfig]
    batch: int = DEFAULT_BATCH
    seq: int = DEFAULT_SEQ
    seed: int = 1234
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logits_dir: str | None = None
    """Where rank 0 writes each layout's logits (`layout<i>.safetensors`, key "logits"), to compare two runs."""


def check_held_out_pairs(count: int, micro_batch_size: int, run: RunConfig, world_size: int) -> None:
    """Held-out pairs run in whole micro-batches on every data-parallel rank: refuse a set too small to fill one."""
    whole = run.parallel.data_parallel_size(world_size) * micro_batch_size
    if count and count < whole:
        raise ConfigError(f"{count} held-out pairs fill no micro-batch of {micro_batch_size} pairs on each of the "
                          f"{whole // micro_batch_size} data-parallel ranks, so none would be scored; give at least "
                          f"{whole} (a multiple of {whole} scores them all).")
    if count % whole:  # said, not dropped silently: the held-out figures are over the pairs that fill micro-batches
        print(f"held-out pairs: {count - count % whole} of {count} are scored (whole micro-batches of {micro_batch_size} "
              f"pairs on each of {whole // micro_batch_size} data-parallel ranks); the last {count % whole} are not. "
              f"Hold out a multiple of {whole} to score them all.")


@dataclass(kw_only=True)
class RewardModelJob(Job):
    """The reward-model worker's job: the training config and the pairs, tokenized."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.reward"
    SPANS_NODES: ClassVar[bool] = True
    REPEATED_STEPS: ClassVar[bool] = True

    run: RunConfig
    rm: RewardModelConfig
    train_pairs: list[list[list[int]]]
    """[chosen ids, rejected ids] per pair: prompt + completion + end token each."""
    train_margins: list[float]
    valid_pairs: list[list[list[int]]]
    valid_margins: list[float]
    pad_id: int

    def check(self, world_size: int, device: Any) -> None:
        self.run.validate(world_size, device)
        check_held_out_pairs(len(self.valid_pairs), self.rm.micro_batch_size, self.run, world_size)


@dataclass(kw_only=True)
class DPOJob(Job):
    """The preference-tuning worker's job: the training config, the pairs tokenized and their answers' reference
    log-probabilities (`dpo.prepare` scored them)."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.dpo"
    SPANS_NODES: ClassVar[bool] = True
    REPEATED_STEPS: ClassVar[bool] = True

    run: RunConfig
    dpo: DPOConfig
    train_ids: list[list[list[int]]]
    """[chosen ids, rejected ids] per pair: the prompt through the template, then the answer through its stop token."""
    train_starts: list[list[int]]
    """Where each side's answer starts (its first token's index)."""
    train_reference: list[list[float]]
    """Each side's answer's log-probability under the reference."""
    valid_ids: list[list[list[int]]]
    valid_starts: list[list[int]]
    valid_reference: list[list[float]]
    pad_id: int

    def check(self, world_size: int, device: Any) -> None:
        self.run.validate(world_size, device)
        check_held_out_pairs(len(self.valid_ids), self.dpo.micro_batch_size, self.run, world_size)


@dataclass(kw_only=True)
class RLJob(Job):
    """The RL worker's job: the policy's training config, the reference, the prompts and the reward; for PPO
    the critic's training config."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.rl"
    SPANS_NODES: ClassVar[bool] = True
    REPEATED_STEPS: ClassVar[bool] = True

    run: RunConfig
    """Model, layout, precision, optimizer, checkpoints (load_dir: the starting policy)."""
    grpo: GRPOConfig | None = None
    ppo: PPOConfig | None = None
    """One of the two: the algorithm and its knobs."""
    reference: str
    reward: str
    """The reward as given: "module:function", or a reward model's checkpoint (then `reward_model`)."""
    reward_model: str | None = None
    reward_model_config: ModelConfig | None = None
    critic: RunConfig | None = None
    """PPO: the critic's training config (load_dir: where it starts; save_dir: the policy's save_dir/critic)."""
    true_reward: str | None = None
    """A "module:function" logged beside the reward and never trained on (reward over-optimisation shows as
    the reward rising while this falls)."""
    records: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    eval_records: list[dict[str, Any]] = field(default_factory=list)
    eval_ids: list[list[int]] = field(default_factory=list)
    eos_ids: list[int]
    pad_id: int

    @property
    def config(self) -> GRPOConfig:
        return self.ppo or self.grpo

    def check(self, world_size: int, device: Any) -> None:
        self.run.validate(world_size, device)
        layout.check(self.run.model, self.run.parallel, world_size, purpose="infer")  # the engine's layout too
        if self.critic is not None:
            self.critic.validate(world_size, device)
        # the training rows are checked as the global batch; the held-out ones go through the same schedule
        whole = self.run.parallel.data_parallel_size(world_size) * self.config.micro_batch_size
        rows = len(self.eval_ids) * self.config.eval_samples
        if rows % whole:
            raise ConfigError(f"held-out prompts x eval_samples = {rows} completions do not split into whole "
                              f"micro-batches of {self.config.micro_batch_size} on every data-parallel rank; make "
                              f"it a multiple of {whole}.")
