"""Every worker's job but the training run's: the typed contract between a recipe and its worker.

A recipe checks its inputs, builds one of these and hands it to `core.launch`; the worker named by its `WORKER`
reads it back from job.json (`core.job.from_dict`, which checks every field's type). The training run's job,
`RunConfig`, is in `core.config`; the knobs a job carries are in their own modules (`core.generation`,
`core.rlhf_config`). The recipes export each job under its old name (`convert.ConvertJob`, `rlhf.RLJob`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pai_cookbook.core import layout
from pai_cookbook.core.config import ConfigError, ModelConfig, ParallelConfig
from pai_cookbook.core.generation import GenerationConfig
from pai_cookbook.core.job import Job

DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default shard size: 5 GB
DIRECTIONS = ("hf2mcore", "mcore2hf", "reshard")


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
