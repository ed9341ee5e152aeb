"""One writer per folder: an advisory lock the launching process holds on every folder a run writes.

    with lock.hold(save_dir, "training"), lock.hold(run_dir, "training"):
        ...  # checks, then launch: a second writer is refused before it starts or deletes anything

The lock is `fcntl.flock` on a hidden file beside the folder (`.<name>.lock`, so the folder itself holds only what
the run writes), and the holder writes its pid, host, time and what it does into it. The kernel drops a lock when
its holder dies, however it dies, so a killed notebook kernel never leaves a folder locked; the next holder says
whose lock it takes over. A process may hold a lock again while it holds it (the recipe and the launcher both
take the run folder's).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from pai_cookbook.core.configs.model_config import ConfigError


class FolderInUse(ConfigError):
    """Another process writes the folder: named with its pid, host, start and task."""


_HELD: dict[Path, list] = {}
"""Lock file -> [open file, depth] of the locks this process holds."""


def lock_file(folder: str | Path) -> Path:
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


def _describe(text: str) -> str:
    try:
        holder = json.loads(text)
        return (f"pid {holder['pid']} on {holder['host']} ({holder['what']}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))})")
    except (ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def hold(folder: str | Path, what: str) -> Iterator[None]:
    """Hold `folder`'s lock for the block.

    Raises:
        FolderInUse: another process holds it: who, and the fix.
    """
    path = lock_file(folder)
    if path in _HELD:
        _HELD[path][1] += 1
        try:
            yield
        finally:
            _HELD[path][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # held past this frame: closed in the finally below
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = _describe(handle.read())
        handle.close()
        raise FolderInUse(f"{Path(folder)} is being written by {holder}; two writers of one folder would corrupt "
                          f"each other's work. Wait for it to finish (or end it), or give this run another "
                          f"folder.") from None
    handle.seek(0)
    before = handle.read().strip()
    if before:
        print(f"lock: {Path(folder)} was last held by {_describe(before)}, which is no longer running; taking it over.")
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "what": what}))
    handle.flush()
    _HELD[path] = [handle, 1]
    try:
        yield
    finally:
        _HELD[path][1] -= 1
        if _HELD[path][1] == 0:
            del _HELD[path]
            handle.seek(0)
            handle.truncate()  # released cleanly: the next holder takes over nothing
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
