"""The worker side of a launch: the job protocol, progress lines, the result, error records.

Every torchrun worker starts the same way. It takes one typed job (a `Job` dataclass, JSON on disk),
and its entry point is tiny:

    @worker.entry(RunConfig)
    def main(config: RunConfig) -> dict:
        with worker.session(config.parallel, config.seed) as device:
            return train(config, device)      # the dict comes back to the notebook

`entry` loads the job, records a crash (so the launcher can name the failing rank) and writes rank
0's returned dict as JSON where `core.launching.launch` reads it. `session` joins the process group, builds
Megatron-Core's parallel state and always tears both down.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from pai_cookbook.core.launching.job import Job, decided

RUN_DIR_ENV = "PAI_COOKBOOK_RUN_DIR"
"""Folder of the current launch: job, per-rank logs, result.json."""
PROGRESS_MARK = "@@pai_cookbook "
"""Prefix of the machine-readable lines that rank 0 prints for the launcher."""
RESULT_FILE = "result.json"
JOB_FILE = "job.json"
ERROR_DIR = "errors"
"""run_dir/errors/rank{N}.json: a failing rank's exception with a precise time, to find the first one."""

J = TypeVar("J", bound=Job)


def open_log(path: Path, fresh: bool):
    """A JSONL log opened for this launch: new when `fresh`, else appended to, after cutting back a last line that a
    killed launch left unfinished (so the first record of this one starts a line of its own)."""
    if not fresh and path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    return path.open("w" if fresh else "a")


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
    (a closed connection), so the earliest record names the rank that broke the run.

    Best effort: on a full disk the record itself may not fit, and the launcher then falls back to
    torchrun's summary and the rank's log (the OS error is in both)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir is None:
        return
    folder = Path(run_dir) / ERROR_DIR
    record = {"rank": rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "time": time.time(),
              "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    path = folder / f"rank{rank()}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))
    except OSError:
        path.unlink(missing_ok=True)  # never leave half a record for the launcher to trip over


def entry(job_type: type[J]) -> Callable[[Callable[[J], dict[str, Any] | None]], Callable[[], None]]:
    """Turn `main(job) -> dict | None` into a torchrun entry point that reads `job_type` from argv[1]."""

    def wrap(main: Callable[[J], dict[str, Any] | None]) -> Callable[[], None]:
        from torch.distributed.elastic.multiprocessing.errors import record

        @record  # torchrun's own error file, for its summary
        def run() -> None:
            global _planned_layers
            try:
                job, plan = job_type.load_planned(sys.argv[1])
                if plan is None:  # a job.json written by hand: decided here as the launcher decides it
                    from pai_cookbook.core.machine import runtime

                    job, device = decided(job, runtime.detect_device())
                    plan = {"layers": device.layers}
                _planned_layers = plan["layers"]
                result = main(job)
            except BaseException as err:
                _write_error(err)
                raise
            if rank() == 0 and result is not None:
                # what this run built, as `session` recorded it: every result says which layers computed it
                _write_result(result if _layers is None else result | {"layers": _layers})

        return run

    return wrap


_layers: dict[str, Any] | None = None
"""This process's `core.machine.build.record`, made once by `session` and written into the result by `entry`."""
_planned_layers: str | None = None
"""The layer path this job builds, as the launcher decided it (job.json's "build"), set by `entry`; None where a
worker's session is opened without one (tests), which then decides on this machine."""


@contextlib.contextmanager
def session(parallel: Any = None, seed: int = 0) -> Iterator[Any]:
    """Join the process group (and build Megatron-Core's parallel state for `parallel`, a
    `ParallelConfig`, when given); always tear both down. Yields the `runtime.DeviceInfo`.

    Workers that run several layouts in one launch pass no `parallel` and use `runtime.each_layout`.
    """
    from pai_cookbook.core.machine import build, device_guard, runtime

    global _layers
    try:
        device = runtime.init_distributed(parallel, seed, _planned_layers)
        _layers = build.record(device)
        if rank() == 0:  # the first line of the run's log (an event: kept in the log, not echoed into a notebook)
            report("layers", **_layers)
        with device_guard.from_environment():
            yield device
    finally:
        runtime.destroy_distributed()
