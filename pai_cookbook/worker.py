"""The worker side of the launcher: progress lines, the structured result, error records.

A worker module (what torchrun runs) stays tiny:

    @worker.entry
    def main(config_path: str) -> dict:
        config = RunConfig.load(config_path)
        device = runtime.init_distributed(config.parallel, config.seed)
        try:
            return train(config, device)          # the dict comes back to the notebook
        finally:
            runtime.destroy_distributed()

`entry` records a crash with torchrun's error file (so the launcher can name the failing rank) and
writes rank 0's returned dict as JSON where `pai_cookbook.launch` reads it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

RUN_DIR_ENV = "PAI_COOKBOOK_RUN_DIR"
"""Folder of the current launch: config, per-rank logs, result.json."""
PROGRESS_MARK = "@@pai_cookbook "
"""Prefix of the machine-readable lines that rank 0 prints for the launcher."""
RESULT_FILE = "result.json"
ERROR_DIR = "errors"
"""run_dir/errors/rank{N}.json: a failing rank's exception with a precise time, to find the first one."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report(event: str, **fields: Any) -> None:
    """Send one structured event (progress, metric) to the launcher; only rank 0's are read."""
    print(PROGRESS_MARK + json.dumps({"event": event, **fields}), flush=True)


def progress(step: int, total: int, **metrics: Any) -> None:
    """Advance the notebook's progress bar to `step` of `total`, showing `metrics` beside it."""
    report("progress", step=step, total=total, **metrics)


def _write_result(result: dict[str, Any]) -> None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir is None:  # run by hand, not by the launcher: print instead
        print(json.dumps(result, indent=2))
        return
    path = Path(run_dir) / RESULT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)  # atomic: the launcher never reads half a result


def _write_error(err: BaseException) -> None:
    """Record this rank's exception; when one rank dies, its peers fail later with secondary errors
    (a closed connection), so the earliest record names the rank that broke the run."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir is None:
        return
    folder = Path(run_dir) / ERROR_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "time": time.time(),
              "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    (folder / f"rank{rank()}.json").write_text(json.dumps(record, indent=2))


def entry(main: Callable[..., dict[str, Any] | None]) -> Callable[[], None]:
    """Wrap a worker's main(*argv) -> dict into a torchrun entry point."""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # torchrun's own error file, for its summary
    def run() -> None:
        try:
            result = main(*sys.argv[1:])
        except BaseException as err:
            _write_error(err)
            raise
        if rank() == 0 and result is not None:
            _write_result(result)

    return run
