"""A write that meets a full disk, said as such: which folder, how much was free, and what a re-run does, where a
library's own words ("unexpected pos 704 vs 598") or a worker's crash would mislead. `core.checkpoints.checkpoint`
re-exports every name here."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from pai_cookbook.core.checkpoints.checkpoint_config import partial_dir

DISK_FULL_BYTES = 64 * 2**20
"""Free space under which a failed save is taken for a full disk."""


def disk_full(err: BaseException, folder: Path, then: str = "a re-run resumes from the last finished checkpoint"
              ) -> BaseException:
    """A save that failed on a full disk, said as such with the folder and `then` (what a re-run does): torch_dist's
    writer reports one as "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598". Any other error is
    returned as it is."""
    where = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free
    if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or free < DISK_FULL_BYTES:
        return OSError(errno.ENOSPC, f"No space left on device while saving {folder} ({free:,} bytes free there; "
                                     f"{type(err).__name__}: {str(err)[:200]}). Free space or save elsewhere; {then}")
    return err


@contextlib.contextmanager
def full_disk_said(*folders: str | Path, then: str = "a re-run resumes from the last finished checkpoint",
                   catch: type[BaseException] = BaseException) -> Iterator[None]:
    """Around a write: an error of type `catch` raised where the disk of one of `folders` is full becomes `disk_full`'s
    OSError naming the first such folder (torch's CheckpointException is not an Exception, hence BaseException by
    default); any other error, and an interrupt, goes on as it was."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except catch as err:
        for folder in folders:
            said = disk_full(err, Path(folder), then)
            if said is not err:
                raise said from err
        raise


@contextlib.contextmanager
def worker_writes(out: str | Path) -> Iterator[None]:
    """Around a launch whose worker writes the checkpoint `out` (through `save`: into `<out>.partial`, renamed into
    place last): a worker that failed where that disk is full is said to have (`disk_full`, naming the folder), not
    as a crash a re-run resumes from, and the unfinished `.partial` it left is removed (never loadable, and it holds
    the disk); any other failure goes on as it was, its `.partial` removed too."""
    from pai_cookbook.core.launching.failures import WorkerError

    partial = partial_dir(out)
    try:
        with full_disk_said(partial, out, then=f"nothing of {Path(out).name} is left half-written; run it again "
                                                 f"where there is room", catch=WorkerError):
            yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
