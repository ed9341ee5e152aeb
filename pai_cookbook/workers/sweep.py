"""The sweep worker: several training runs one after another in one launch (`pai_cookbook.train.sweep`).

torchrun's and Megatron-Core's start-up are paid once; the process group is kept and Megatron-Core's
parallel state is rebuilt for each run (`runtime.each_layout`), so a run is exactly what `train.run` of
its config would train. Each run logs into its own folder under the launch's run folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import Sweep
from pai_cookbook.core.machine import runtime
from pai_cookbook.workers.training import train


@worker.entry(Sweep)
def main(job: Sweep) -> dict[str, Any]:
    run_dir = Path(os.environ.get(worker.RUN_DIR_ENV, "."))
    total = sum(config.train_iters for config in job.runs)
    results, done = [], 0
    with worker.session() as planned:
        devices = runtime.each_layout(((config.parallel, config.seed) for config in job.runs), planned.layers)
        for name, folder, config, device in zip(job.names, job.folders, job.runs, devices):
            results.append(train(config, device, log_dir=run_dir / folder, progress=(name, done, total)))
            done += config.train_iters
    return {"runs": results}


if __name__ == "__main__":
    main()
