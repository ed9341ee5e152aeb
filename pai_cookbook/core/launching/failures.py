"""Which rank broke a launch, and what it said: the first real failure among the ranks' error records and torchrun's
observations (a peer's lost-connection error is never the cause), and the tail of that rank's log, raised as a
`WorkerError` in the notebook cell."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

from pai_cookbook.core.launching import worker

LOG_TAIL_LINES = 40
# One entry of torchrun's failure summary: "rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: ...)".
FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# Errors a rank raises because a *peer* went away: a consequence, not the cause. A failing rank's own
# teardown (destroy_process_group in a finally) can make its peers raise these before the failing
# rank's exception is even recorded, so time alone cannot order them.
SECONDARY_ERRORS = re.compile(r"Connection (reset|closed) by peer|Broken pipe|communicator was aborted|"
                              r"DistNetworkError|Socket Timeout|NCCL watchdog", re.I)


class WorkerError(RuntimeError):
    """A worker exited non-zero; carries the failing rank and the tail of its log."""

    def __init__(self, rank: int | None, exitcode: int | None, log_tail: str, log_dir: Path):
        self.rank, self.exitcode, self.log_tail, self.log_dir = rank, exitcode, log_tail, log_dir
        who = f"rank {rank}" if rank is not None else "a worker"
        super().__init__(f"{who} failed (exit code {exitcode}); logs in {log_dir}\n"
                         f"--- last lines of {who}'s log ---\n{log_tail}")


def first_failure(run_dir: Path, torchrun_output: str) -> tuple[int | None, int | None, int | None]:
    """(rank, local_rank, exit code) of the failure that broke the run.

    A rank killed by a signal (segfault, OOM killer: negative exit code other than torchrun's own
    SIGTERM) left no Python error and is the cause; otherwise the earliest error a rank recorded
    (`worker.entry`) that is not a lost-peer error; otherwise torchrun's own first observation.
    """
    failures = [tuple(int(g) for g in m.groups()) for m in FAILURE.finditer(torchrun_output)]
    for failure in failures:
        if failure[2] < 0 and failure[2] != -signal.SIGTERM:
            return failure
    records = [r for r in map(read_record, (run_dir / worker.ERROR_DIR).glob("rank*.json")) if r]
    primary = [r for r in records if not SECONDARY_ERRORS.search(r["error"])]
    if not primary:
        # Only lost-peer errors were recorded: the rank that broke the run could not write its record (a full
        # disk); torchrun's own error file of each failed rank may still hold its exception.
        for rank, local_rank, code in failures:
            message = torchrun_error(run_dir / "logs", local_rank)
            if message and not SECONDARY_ERRORS.search(message):
                return rank, local_rank, code
    if records:
        first = min(primary or records, key=lambda r: r["time"])
        code = next((f[2] for f in failures if f[0] == first["rank"]), 1)
        if code == -signal.SIGTERM:
            # It raised (the record), and torchrun, seeing a peer's secondary error first, terminated it while it
            # was still tearing down: its exit is its exception's, as when it gets to exit on its own.
            code = 1
        return first["rank"], first["local_rank"], code
    return failures[-1] if failures else (None, None, None)


def torchrun_error(log_dir: Path, local_rank: int) -> str | None:
    """The exception message torchrun's error file (the worker's `@record`) holds for a local rank, newest run."""
    files = sorted(log_dir.glob(f"*/attempt_*/{local_rank}/error.json"), key=lambda p: p.stat().st_mtime)
    try:
        return json.loads(files[-1].read_text())["message"]["message"] if files else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_record(path: Path) -> dict[str, Any] | None:
    """A rank's error record; None for one that could not be written whole (a full disk)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rank_log_tail(log_dir: Path, local_rank: int | None, lines: int = LOG_TAIL_LINES) -> str:
    """Tail of one local rank's stderr+stdout as torchrun saved them (newest attempt)."""
    candidates = sorted(log_dir.glob(f"*/attempt_*/{local_rank if local_rank is not None else '*'}"),
                        key=lambda p: p.stat().st_mtime)
    chunks = [tail(folder / name, lines) for folder in candidates[-1:] for name in ("stderr.log", "stdout.log")]
    return "\n".join(filter(None, chunks)) or "(the rank wrote no log)"


def tail(path: Path, lines: int) -> str:
    if not path.exists() or not path.stat().st_size:
        return ""
    return f"[{path.name}]\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
