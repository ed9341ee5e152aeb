"""Every worker's job but the training run's: the typed contract between a recipe and its worker.

A recipe checks its inputs, builds one of these and hands it to `core.launch`; the worker named by its `WORKER`
reads it back from job.json (`core.job.from_dict`, which checks every field's type). The training run's job,
`RunConfig`, is in `core.config`; the knobs a job carries are in their own modules (`core.generation`,
`core.rlhf_config`). The recipes export each job under its old name (`convert.ConvertJob`, `rlhf.RLJob`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pai_cookbook.core import layout
from pai_cookbook.core.config import ConfigError, ModelConfig, ParallelConfig, PrecisionConfig, RunConfig
from pai_cookbook.core.generation import GenerationConfig
from pai_cookbook.core.job import Job
from pai_cookbook.core.logit_parity import DEFAULT_BATCH, DEFAULT_SEQ

DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default shard size: 5 GB
DIRECTIONS = ("hf2mcore", "mcore2hf", "reshard")
INITS = ("mean", "hf_mean", "random")
"""New rows: mean of the sub-token rows; transformers' `resize_token_embeddings(mean_resizing=True)`
(a sample of N(mean of all rows, 1e-9 x their covariance)); N(0, init_method_std), as a fresh model."""


@dataclass(kw_only=True)
class ConvertJob(Job):
    """The conversion worker's job: one direction, a source, a destination (a `.partial` folder for
    the streaming directions), and the layout for `reshard`."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.convert"

    direction: Literal["hf2mcore", "mcore2hf", "reshard"]
    src: str
    dst: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Layout the `reshard` direction loads and saves at (the streaming directions run on one process)."""
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    """mcore2hf: the largest safetensors shard."""
    model: ModelConfig | None = None
    """hf2mcore: the source's config as `inspect_hf` read it before launch."""

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"direction {self.direction!r} is not one of {DIRECTIONS}.")

    def processes(self) -> int:
        return layout.world_size(self.parallel) if self.direction == "reshard" else 1


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
