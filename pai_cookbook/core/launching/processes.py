"""The launcher's processes end with it: torchrun and its workers are terminated on any end of a launch (a signal,
Ctrl-C, a timeout, an error), SIGTERM and SIGHUP to the launcher end them too before they end it, and the launched
process asks the kernel for SIGTERM when the launcher dies (a notebook kernel restarted, the OOM killer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import psutil

TERMINATE_GRACE_S = 5.0
"""Seconds workers get to exit after SIGTERM before SIGKILL."""

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal a process gets when the thread that started it ends."""


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM torchrun and all its descendants, SIGKILL whatever is still alive after the grace."""
    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with ignore_gone():
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=TERMINATE_GRACE_S)
    for p in alive:
        with ignore_gone():
            p.kill()
    psutil.wait_procs(alive, timeout=TERMINATE_GRACE_S)
    try:
        proc.wait(timeout=TERMINATE_GRACE_S)  # bounded: a launcher that cleans up must not hang itself
    except subprocess.TimeoutExpired:
        proc.kill()


class ignore_gone:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is psutil.NoSuchProcess


class Signals:
    """While a launch runs: SIGTERM and SIGHUP raise `Terminated` in the launching thread, so the
    launch's cleanup ends every worker; afterwards the signal is re-sent with the process's own
    handler restored, so it ends the process as it would have without the launch."""

    HANDLED = (signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for signum in self.HANDLED:
                self.previous[signum] = signal.signal(signum, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Terminated(signum)

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if isinstance(exc, Terminated):
            os.kill(os.getpid(), exc.signum)


class Terminated(BaseException):
    """The launcher received SIGTERM or SIGHUP; its workers have been terminated."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}; every worker was terminated")


def death_signal() -> Callable[[], None] | None:
    """What the launched process runs before its program (Linux): it asks the kernel for SIGTERM when the launching
    thread ends, however it ends (a notebook kernel restarted, the OOM killer), and torchrun then ends its workers as
    on any SIGTERM. libc is looked up here, before the fork: the child only makes the call."""
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
