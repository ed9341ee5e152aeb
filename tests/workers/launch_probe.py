"""Workers for tests/test_launch.py (no Megatron: they test the launcher alone).

launch_probe.py MODE RUN_DIR
  ok     every rank joins a gloo group; rank 0 reports 3 progress steps and returns a result
  crash  rank 1 raises; rank 0 waits in a barrier it never leaves
  hang   every rank writes its pid to RUN_DIR/pid.RANK and sleeps until killed
"""

import os
import time
from pathlib import Path

import torch.distributed as dist

from pai_cookbook import worker


@worker.entry
def main(mode: str, run_dir: str) -> dict | None:
    rank = worker.rank()
    if mode == "hang":
        Path(run_dir, f"pid.{rank}").write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    dist.init_process_group("gloo")
    try:
        if mode == "crash":
            if rank == 1:
                print("rank 1 is about to fail", flush=True)
                raise RuntimeError("deliberate failure on rank 1")
            dist.barrier()
        for step in range(1, 4):
            worker.progress(step, 3, loss=1.0 / step)
        print("ordinary output line", flush=True)
        return {"world_size": dist.get_world_size(), "mode": mode}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
