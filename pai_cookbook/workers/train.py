"""The training worker: runs a `RunConfig` (`workers.training.train`), checked by `pai_cookbook.train.run` before launch;
`main` joins the process group, trains (or continues) and always tears down.
"""

from __future__ import annotations

from typing import Any

from pai_cookbook.core.configs.config import RunConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.workers.training import train


@worker.entry(RunConfig)
def main(config: RunConfig) -> dict[str, Any]:
    with worker.session(config.parallel, config.seed) as device:
        return train(config, device)


if __name__ == "__main__":
    main()
