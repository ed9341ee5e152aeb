"""Workers for tests/test_launch.py (no Megatron: they test the launcher alone).

Job: ProbeJob(mode, run_dir) (SteppingProbeJob: the same, declaring REPEATED_STEPS)
  ok     every rank joins a gloo group; rank 0 reports 3 progress steps and returns a result
  crash  the last rank raises (rank 1 of 2, rank 0 of 1); rank 0 of 2 waits in a barrier it never leaves
  hang   every rank writes its pid to RUN_DIR/pid.RANK and sleeps until killed
  enospc rank 1 hits a full disk: its error record cannot be written (it is /dev/full) and it raises
         the OS error, as a checkpoint write on a full disk does
"""

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch.distributed as dist

from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.job import Job


@dataclass(kw_only=True)
class ProbeJob(Job):
    WORKER: ClassVar[str] = __file__

    mode: str
    run_dir: str


@dataclass(kw_only=True)
class SteppingProbeJob(ProbeJob):
    """A probe that declares repeated steps, as training jobs do."""

    REPEATED_STEPS: ClassVar[bool] = True


@worker.entry(ProbeJob)
def main(job: ProbeJob) -> dict | None:
    mode, run_dir = job.mode, job.run_dir
    rank = worker.rank()
    if mode == "hang":
        Path(run_dir, f"pid.{rank}").write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    dist.init_process_group("gloo")
    try:
        if mode == "enospc" and rank == 1:
            records = Path(os.environ[worker.RUN_DIR_ENV]) / worker.ERROR_DIR
            records.mkdir(exist_ok=True)
            (records / "rank1.json").symlink_to("/dev/full")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{run_dir}/iter_0000010.partial/__1_0.distcp")
        if mode == "crash":
            if rank == dist.get_world_size() - 1:
                print(f"rank {rank} is about to fail", flush=True)
                raise RuntimeError(f"deliberate failure on rank {rank}")
            dist.barrier()
        for step in range(1, 4):
            worker.progress(step, 3, loss=1.0 / step)
        print("ordinary output line", flush=True)
        # torchrun names its run in every worker's environment
        return {"world_size": dist.get_world_size(), "mode": mode, "under_torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
                "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE"), "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
