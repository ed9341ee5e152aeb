"""A server's keeper: runs a command in its own process group and ends the whole group with itself.

    python pai_cookbook/workers/supervise.py vllm-python -m vllm.entrypoints.openai.api_server ...

`serve.Server` starts this (by path, standard library only: it starts in milliseconds) instead of the server itself,
with the kernel's death signal set, so that however the notebook ends (the `with` block, an interrupt, a kernel
killed or restarted) SIGTERM reaches this process, which ends every process in the server's group, the engine and
workers the server started included, even those it left behind when it died. Its exit code is the server's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

GRACE_S = 10.0
"""Seconds the server's group gets after SIGTERM before SIGKILL."""


def end_group(pgid: int, child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    child = subprocess.Popen(argv, start_new_session=True)

    def stop(signum, frame):
        end_group(child.pid, child)
        sys.exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    code = child.wait()
    end_group(child.pid, child)  # the server is gone: what it left in its group goes too
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
