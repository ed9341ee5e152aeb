"""Training runs that count what each rank holds, for tests/test_plan.py, executed under torchrun by `core.launch`.

Job: MemoryRuns(configs, record)
  Each config (with `measure_memory=True`) trains through the training worker's own loop (`workers.training.train`)
  in its own Megatron-Core parallel state, one launch for all; returns each run's every-rank `memory` figures.
  With `record`, each config is instead stepped by `build` and `train_step` with a recording probe, and the storages
  live at the activation peak come back too (to see what makes a term up). The result's "layers" (added by
  `core.worker`) records which layers ran.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from pai_cookbook.core import runtime, worker
from pai_cookbook.core.config import RunConfig
from pai_cookbook.core.job import Job
from pai_cookbook.core.memory_probe import MemoryProbe
from pai_cookbook.workers.training import build, train, train_step


@dataclass(kw_only=True)
class MemoryRuns(Job):
    WORKER: ClassVar[str] = __file__

    configs: list[RunConfig] = field(default_factory=list)
    record: bool = False

    def check(self, world_size: int, device) -> None:
        for config in self.configs:
            config.validate(world_size, device)


def _recorded(config: RunConfig, device) -> list[dict]:
    model, optimizer, scheduler = build(config, device)
    probe = MemoryProbe(record=True)
    for step in range(config.train_iters):
        train_step(config, model, optimizer, scheduler, step, None, probe)
    return probe.gather()


@worker.entry(MemoryRuns)
def main(job: MemoryRuns) -> dict:
    with worker.session():
        devices = runtime.each_layout((c.parallel, c.seed) for c in job.configs)
        return {"runs": [_recorded(config, device) if job.record else train(config, device)["memory"]
                         for config, device in zip(job.configs, devices)]}


if __name__ == "__main__":
    main()
