"""Run a worker's job under torchrun from a notebook cell, a script or a cluster job.

`launch(config, nproc_per_node=2)` (any `Job`: a RunConfig, a ConvertJob, ...):
- checks the job against the world size and the device (`job.check`) before any process starts;
- writes it to run_dir/job.json and runs `python -m job.WORKER job.json` under torchrun, built as an
  argv list (never a shell string); a world of one process on one machine runs the worker directly with
  the variables torchrun would give it (torchrun's own start is a second Python importing torch); a free
  local port on one machine, the scheduler's MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK on a multi-node job
  (`runtime.detect_launch_env`) for jobs that span nodes (training); a job of a fixed small world
  (conversion, parity, generation) runs on node 0 alone and the other nodes get its result (`core.launching.nodes`);
- streams rank 0's output live (its progress events drive a tqdm bar, which renders as a widget in
  Jupyter and as text under papermill), keeps every rank's stdout/stderr in files under the run folder;
- returns rank 0's result dict; on a non-zero exit raises `WorkerError` with the failing rank and the
  tail of its log; on KeyboardInterrupt (the notebook's stop button), SIGTERM or SIGHUP (a scheduler's
  cancel, `kill`, `timeout`, a closed terminal) or a timeout it terminates torchrun and every worker
  below it, so no process is left behind, then lets the signal end the process as it would have.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.core.launching import failures, nodes, processes, worker
from pai_cookbook.core.launching.failures import WorkerError
from pai_cookbook.core.launching.job import Job, decided
from pai_cookbook.core.machine import build, runtime

# Warnings every CPU worker would print, advising a CUDA setting (on CUDA the launcher sets it); kept out of the
# notebook on the CPU path only.
CPU_BENIGN_WARNINGS = ("When using async grad allreduce", "When using sequence parallelism it is recommended")
# On every device: Megatron-Core's import-time notice that TE/Apex are missing (the environment report
# says which layers run, once; `pai_cookbook/__init__` filters it in the notebook process too), and
# deprecations raised inside Megatron-Core and torch's checkpoint code (Megatron-Core's default
# cuda_graph_scope; its use of torch DCP's load_state_dict and ShardedTensor): nothing to act on.
# Also Megatron-Core's GPT dataset noting that a tokenizer's pad id equals another special id (SmolLM2's pad
# is its EOS): the cookbook's samples are packed windows of documents, never padded, so nothing is masked;
# and torch deprecating collectives that Megatron-Core's MoE dispatcher and distributed optimizer call.
ALWAYS_BENIGN_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                          "full scope is deprecated", "`load_state_dict` is deprecated", "Please use DTensor instead",
                          "The pad token id in the tokenizer collides",
                          # Megatron-Core 0.16 announcing the static engine's future removal (GRPO's rollouts use it)
                          "The static engine will be deprecated",
                          # torch's deprecation of the collectives Megatron-Core's MoE dispatcher and distributed
                          # optimizer call
                          "`torch.distributed.all_gather_into_tensor` is deprecated",
                          "`torch.distributed.reduce_scatter_tensor` is deprecated",
                          # Megatron-Core 0.19 announcing, at import, that a multimodal model config is experimental
                          "MimoModelConfig is experimental",
                          # torch's checkpoint loader on how Megatron-Core 0.19's torch_dist load calls it (the reader
                          # passed by position): on every load. Its no_dist=True warning is filtered in
                          # pai_cookbook/__init__ (its text has commas, which PYTHONWARNINGS cannot carry).
                          "The argument order of load has been changed")
THP_ENV = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch for transparent huge pages under its CPU allocator (c10's alloc_cpu: madvise(MADV_HUGEPAGE) on
allocations of 2 MB or more). Opt-in: set it in the environment and every worker inherits it. Not the default: its
gain inside a whole generation step was not separated from the machine's noise (docs/megatron-core-on-cpu.md)."""
GLIBC_TUNABLES_ENV = "GLIBC_TUNABLES"
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"
"""glibc's allocator told to serve every block from its heap and never give the heap's top back: what a step frees
is there for the next step, where by default a block above the mmap threshold (32 MB at most) is unmapped on free
and faulted back in page by page next step. Given to the CPU workers of jobs with `REPEATED_STEPS` unless the
environment sets GLIBC_TUNABLES itself (docs/megatron-core-on-cpu.md has the page faults, memory and speed
before and after). Ignored by other C libraries."""
_EVENT_DECODER = json.JSONDecoder()
_RANK_PREFIX = re.compile(r"^\[default\d+\]:")


def benign_warnings(device: runtime.DeviceInfo) -> tuple[str, ...]:
    """The warnings kept out of a notebook for a job on `device` (the starts of their messages)."""
    return ALWAYS_BENIGN_WARNINGS + (() if device.is_cuda else CPU_BENIGN_WARNINGS)


def run_here(job: Job) -> dict[str, Any]:
    """Run a one-process job in this process instead of a worker: its worker module's `run(job, device)` inside
    `runtime.world_of_one()`, checked first as `launch` checks it, with the warnings a worker's environment
    filters filtered here too. For short jobs that build no real model (the streaming conversions) where
    `runtime.can_host_world_of_one()`; everything else, and everything with a timeout, is a worker. (The worker
    module is imported here, by the launcher, as torchrun would run it: a recipe never imports a worker.)
    """
    import importlib

    run = importlib.import_module(job.WORKER).run
    with runtime.world_of_one() as device, warnings.catch_warnings():
        for message in benign_warnings(device):
            warnings.filterwarnings("ignore", message=re.escape(message))
        job, device = decided(job, device)
        job.check(1, device)
        return run(job, device)


def torchrun_argv(module: str, args: Sequence[str], nproc_per_node: int, env: runtime.LaunchEnv,
                  log_dir: Path) -> list[str]:
    """The torchrun command line: rank 0 teed to our stdout, every rank's output kept in log_dir."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(env.nnodes), "--node-rank", str(env.node_rank),
        "--nproc-per-node", str(nproc_per_node),
        "--master-addr", env.master_addr, "--master-port", str(env.master_port),
        "--max-restarts", "0",
        "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
        *(["-m", module] if not module.endswith(".py") else [module]), *args,
    ]


def single_process_argv(module: str, args: Sequence[str]) -> list[str]:
    """The worker's own command line, for a world of one process (no torchrun)."""
    return [sys.executable, *(["-m", module] if not module.endswith(".py") else [module]), *args]


def single_process_env(environ: dict[str, str], env: runtime.LaunchEnv) -> dict[str, str]:
    """`environ` as torchrun would give it to the only worker of a one-process world: the scheduler's node-level
    WORLD_SIZE and RANK, if any, overridden; an outer torchrun's own variables (a launch from inside a worker)
    dropped: with TORCHELASTIC_USE_AGENT_STORE the worker would wait for a rendezvous store nobody serves."""
    inherited = {k: v for k, v in environ.items() if not k.startswith(_TORCHRUN_OWN)}
    return inherited | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                        "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port)}


_TORCHRUN_OWN = ("TORCHELASTIC_", "ROLE_", "GROUP_WORLD_SIZE")


SINGLE_PROCESS_LOG = Path("single_process", "attempt_0", "0", "output.log")
"""Where a one-process launch keeps its worker's output (stdout and stderr as they came), under log_dir: torchrun's
<run id>/attempt_<n>/<local rank>/ layout, so a failure's log tail is found the same way."""


def _threads_per_worker(nproc_per_node: int) -> int:
    # 2 cores / 2 workers = 1 thread each: oversubscribed BLAS threads make CPU runs several times slower.
    return max(1, (os.cpu_count() or 1) // nproc_per_node)


class _Progress:
    """A tqdm bar driven by the workers' progress events (created on the first one)."""

    def __init__(self, desc: str, enabled: bool):
        self.desc, self.enabled, self.bar, self.events = desc, enabled, None, []

    def update(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if not self.enabled or event.get("event") != "progress":
            return
        if self.bar is None:
            from pai_cookbook.core.launching import progress

            self.bar = progress.bar(total=event["total"], desc=self.desc)
        self.bar.update(event["step"] - self.bar.n)
        metrics = {k: v for k, v in event.items() if k not in ("event", "step", "total")}
        self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in metrics.items()})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def split_event(line: str) -> tuple[dict[str, Any] | None, str]:
    """(event, the rest of the line) for a line of a worker's output; (None, line) for an ordinary line.

    torchrun tees a rank's stdout and stderr into one stream, so another write (a warning) can land on
    the same line as an event, after it: the event is the first JSON object after the mark.
    """
    if not line.startswith(worker.PROGRESS_MARK):
        return None, line
    try:
        event, end = _EVENT_DECODER.raw_decode(line, len(worker.PROGRESS_MARK))
    except ValueError:
        return None, line
    return event, line[end:].strip()


def _stream(proc: subprocess.Popen, on_line: Callable[[str], None], log_path: Path | None = None) -> None:
    """Read the workers' merged output to its end; with `log_path` (a one-process launch, which torchrun does not
    log) keep every line there as well, as long as the disk takes it: the pipe is drained either way, or a
    worker that goes on printing would block on a full pipe."""
    log = None
    try:
        if log_path is not None:
            with contextlib.suppress(OSError):
                log = log_path.open("w", encoding="utf-8", errors="replace")
        for raw in proc.stdout:
            line = _RANK_PREFIX.sub("", raw.rstrip("\n"))
            if log is not None:
                try:
                    log.write(line + "\n")
                    log.flush()  # a crash's tail is read from the file
                except OSError:  # a full disk: stop keeping the log, go on reading
                    _close_quietly(log)
                    log = None
            on_line(line)
    finally:
        _close_quietly(log)


def _close_quietly(log) -> None:
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()


def launch(job: Job, *, nproc_per_node: int = 1, run_dir: str | Path = "runs/latest",
           timeout_s: float | None = None, show_progress: bool = True, echo: bool = True,
           env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `job` under torchrun (a one-process world without it) and return rank 0's result.

    Args:
        job: the worker's job (`Job`); checked against the world size and device, then written
            to run_dir/job.json, which the worker module `job.WORKER` reads.
        nproc_per_node: processes on this machine (GPUs per node on a GPU machine).
        run_dir: folder for job.json, result.json and logs/ (created; reused runs are overwritten).
        timeout_s: terminate all workers and raise TimeoutError after this many seconds.
        show_progress: drive a progress bar from the workers' progress events.
        echo: print rank 0's ordinary output lines.
        env: extra environment variables for the workers.
    Returns:
        The dict rank 0's main returned (empty if it returned None), plus "events": the progress and
        metric events rank 0 reported, in order.
    Raises:
        ConfigError: the job does not fit the world size or device (nothing was started).
        WorkerError: a worker exited non-zero; names the rank and shows its log tail.
        TimeoutError: timeout_s passed; every worker was terminated.
        KeyboardInterrupt: re-raised after every worker was terminated.
        processes.Terminated: SIGTERM or SIGHUP arrived; every worker was terminated, then the signal is re-sent
            to this process with its own handler (by default it ends the process).
        nodes.NodeError: on a node other than 0 of a multi-node job, node 0 failed or never came.
    """
    kwargs = dict(nproc_per_node=nproc_per_node, run_dir=run_dir, timeout_s=timeout_s, show_progress=show_progress,
                  echo=echo, env=env)
    if not job.SPANS_NODES:  # a fixed small world: node 0 runs it, the other nodes get its result
        return _on_node0(job, **kwargs)
    launch_env = runtime.detect_launch_env()
    result = _launch(job, launch_env, **kwargs)
    return _rank0_result(result) if launch_env.multi_node else result


@nodes.node0_only
def _on_node0(job: Job, **kwargs: Any) -> dict[str, Any]:
    return _launch(job, runtime.local_launch_env(), **kwargs)


@nodes.node0_only
def _rank0_result(result: dict[str, Any]) -> dict[str, Any]:
    """Global rank 0 runs on node 0: its result is the one every node returns."""
    return result


def _launch(job: Job, launch_env: runtime.LaunchEnv, *, run_dir: str | Path, **kwargs: Any) -> dict[str, Any]:
    from pai_cookbook.core.launching import lock

    # two launches into one run folder would mix their files; node 0's launch holds it (a shared filesystem shows
    # one lock to every node)
    held = lock.hold(run_dir, job.WORKER.rsplit(".", 1)[-1]) if launch_env.node_rank == 0 else contextlib.nullcontext()
    with held:
        return _launch_locked(job, launch_env, run_dir=run_dir, **kwargs)


def user_paths() -> list[str]:
    """The folders on this process's sys.path that Python did not put there (not under its prefixes, not a
    site-packages): a notebook's `sys.path.insert(0, "my_rewards")`, which a worker needs to import the same names."""
    roots = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found = []
    for entry in sys.path:
        if not entry or not Path(entry).is_dir():
            continue
        path = Path(entry).resolve()
        if any(path == root or root in path.parents for root in roots) or path.name in ("site-packages",
                                                                                        "dist-packages"):
            continue
        if str(path) not in found:
            found.append(str(path))
    return found


def _launch_locked(job: Job, launch_env: runtime.LaunchEnv, *, nproc_per_node: int, run_dir: str | Path,
                   timeout_s: float | None, show_progress: bool, echo: bool,
                   env: dict[str, str] | None) -> dict[str, Any]:
    device = runtime.detect_device({**os.environ, **(env or {})})
    if device.is_cuda and nproc_per_node > device.count:
        raise ValueError(f"nproc_per_node={nproc_per_node} but this node has {device.count} GPU(s); "
                         f"use at most {device.count} processes per node.")
    job, device = decided(job, device)  # the machine's choices made once, here: the workers read them from job.json
    job.check(launch_env.world_size(nproc_per_node), device)
    run_dir = Path(run_dir).resolve()
    log_dir = run_dir / "logs"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / worker.RESULT_FILE).unlink(missing_ok=True)
    for stale in (run_dir / worker.ERROR_DIR).glob("rank*.json"):
        stale.unlink()
    job_file = job.save(run_dir / worker.JOB_FILE, build=build.record(device))
    single = launch_env.nnodes == 1 and nproc_per_node == 1
    child_env = {**os.environ, **(env or {}), worker.RUN_DIR_ENV: str(run_dir), "PYTHONUNBUFFERED": "1"}
    single_log = log_dir / SINGLE_PROCESS_LOG if single else None  # torchrun keeps its workers' logs itself
    if single:
        argv = single_process_argv(job.WORKER, [str(job_file)])
        child_env = single_process_env(child_env, launch_env)
        single_log.parent.mkdir(parents=True, exist_ok=True)
    else:
        argv = torchrun_argv(job.WORKER, [str(job_file)], nproc_per_node, launch_env, log_dir)
    child_env.setdefault("OMP_NUM_THREADS", str(_threads_per_worker(nproc_per_node)))
    added = user_paths()
    if added:  # what the caller put on sys.path (a notebook's folder of reward functions) the workers import too
        child_env["PYTHONPATH"] = os.pathsep.join(added + [p for p in [child_env.get("PYTHONPATH")] if p])
    if job.REPEATED_STEPS and device.cpu_converters:  # core.machine.build.CPU_CONVERTERS["glibc_keep_freed_memory"]
        child_env.setdefault(GLIBC_TUNABLES_ENV, KEEP_FREED_MEMORY)
    # The workers' own tqdm bars (Megatron-Core's static engine draws one per generate call: a line per GRPO
    # step) would stream into the notebook as text; rank 0's progress events drive the launcher's bar instead.
    child_env.setdefault("TQDM_DISABLE", "1")
    child_env["PYTHONWARNINGS"] = ",".join(filter(None, [child_env.get("PYTHONWARNINGS")] +
                                                  [f"ignore:{message}" for message in benign_warnings(device)]))
    if device.is_cuda:
        # Megatron-Core orders TP communication before compute kernels with a single CUDA queue.
        child_env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    progress = _Progress(desc=job.WORKER.rsplit(".", 1)[-1], enabled=show_progress)
    output: list[str] = []

    def on_line(line: str) -> None:
        event, line = split_event(line)
        if event is not None:
            progress.update(event)
        if not line:
            return
        output.append(line)
        if echo:
            print(line, flush=True)

    with processes.Signals():
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                                start_new_session=True,  # own process group: a notebook interrupt reaches us only
                                preexec_fn=processes.death_signal())
        reader = threading.Thread(target=_stream, args=(proc, on_line, single_log), daemon=True)
        started = time.monotonic()
        try:
            reader.start()  # inside the try: an interrupt from here on ends the workers too
            while proc.poll() is None:
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    processes.terminate(proc)
                    raise TimeoutError(f"{job.WORKER} ran past timeout_s={timeout_s}; all workers were terminated. "
                                       f"Logs in {log_dir}")
                time.sleep(0.1)
            if single:  # what the worker started goes with it, as torchrun ends each worker's process group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        except BaseException:
            processes.terminate(proc)
            raise
        finally:
            if reader.ident is not None:  # started
                reader.join(timeout=processes.TERMINATE_GRACE_S)
            progress.close()

    if proc.returncode != 0:
        if single:
            tail = failures.tail(single_log, failures.LOG_TAIL_LINES) or "(the rank wrote no log)"
            raise WorkerError(0, proc.returncode, tail, log_dir)
        rank, local_rank, code = failures.first_failure(run_dir, "\n".join(output))
        raise WorkerError(rank, code if code is not None else proc.returncode,
                          failures.rank_log_tail(log_dir, local_rank), log_dir)
    result_file = run_dir / worker.RESULT_FILE
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    result["events"] = progress.events
    return result
