"""Where the cookbook runs: device, communication backend, launch environment, distributed setup.

Three questions are answered here and nowhere else:
- *Which hardware path?* CUDA -> NCCL, Transformer Engine when importable, bf16/FP8 where the GPU has them. No
  CUDA -> gloo, with the CPU compatibility layer (`core.machine.compat`) applied once before any model is built.
- *What does a run build here?* The facts are read here (`detect_device`: CUDA, Transformer Engine, the GPU); the
  decision made from them is `core.machine.build`'s, carried as `DeviceInfo.layers` (Transformer Engine's spec,
  Megatron-Core's local one, or that plus the CPU converters), from which every other choice follows.
- *Which launch environment?* A single machine (PAI-DSW, a laptop, CI) gets a free local rendezvous port; a
  multi-node job (PAI-DLC) is recognised by MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK, where WORLD_SIZE
  counts *nodes* and RANK is the node index (PAI-DLC's PyTorch jobs and the seed project's launch scripts).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import random
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.machine import build

SCHEDULER_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")  # node-level: WORLD_SIZE nodes, RANK node index
DEFAULT_MASTER_PORT = 29500
DIST_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class DeviceInfo:
    """The accelerator this process would use."""

    is_cuda: bool
    name: str
    count: int  # GPUs visible to this process (0 on CPU)
    compute_capability: tuple[int, int] | None
    backend: str
    """torch.distributed backend: nccl on CUDA, gloo on CPU."""
    has_transformer_engine: bool
    has_flash_attn: bool
    layers: str = "local"
    """Which layers a run builds here (`build.choose_layers`, narrowed by the job): one of `build.LAYER_PATHS`. Every
    choice of what to build is a property of it, below."""

    @property
    def cpu_converters(self) -> bool:
        """True where the cookbook's CPU speed work (`pai_cookbook.cpu`) is applied: the one test of it."""
        return self.layers == build.CPU_LAYERS

    @property
    def transformer_engine(self) -> bool:
        """True where the layers are Transformer Engine's (its attention, linears, packed sequences)."""
        return self.layers == build.TE_LAYERS

    @property
    def fused_kernels(self) -> bool:
        """Megatron-Core's fused kernels (`build.FUSED_KERNELS`): on Transformer Engine's path only."""
        return build.fused_kernels(self.layers)

    @property
    def grouped_gemm(self) -> bool:
        """MoE experts as one grouped GEMM where the model does not say (`build.grouped_gemm`)."""
        return build.grouped_gemm(self.layers)

    @property
    def supports_bf16(self) -> bool:
        return not self.is_cuda or (self.compute_capability or (0, 0)) >= (8, 0)

    @property
    def supports_fp8(self) -> bool:
        return self.is_cuda and self.has_transformer_engine and (self.compute_capability or (0, 0)) >= (9, 0)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def detect_device(environ: Mapping[str, str] | None = None) -> DeviceInfo:
    """The local accelerator, without a process group; its layers by `build.choose_layers` on `environ` (default:
    ours), before a job narrows them (`core.launching.job.decided`)."""
    if torch.cuda.is_available():
        te = _importable("transformer_engine")
        return DeviceInfo(
            is_cuda=True,
            name=torch.cuda.get_device_name(0),
            count=torch.cuda.device_count(),
            compute_capability=torch.cuda.get_device_capability(0),
            backend="nccl",
            has_transformer_engine=te,
            has_flash_attn=_importable("flash_attn"),
            layers=build.choose_layers(True, te, environ),
        )
    return _cpu_device(build.choose_layers(False, False, environ))


def host_device() -> DeviceInfo:
    """The host's CPU, GPUs present or not: for models that only describe names and shapes (conversion's
    meta-device model), which must never be moved to a GPU. Its layers are the local spec: such a model computes
    nothing, and its parameter names are the same on every path."""
    return _cpu_device(build.LOCAL_LAYERS)


def _cpu_device(layers: str) -> DeviceInfo:
    return DeviceInfo(
        is_cuda=False, name=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        count=0, compute_capability=None, backend="gloo",
        has_transformer_engine=False, has_flash_attn=False, layers=layers,
    )


@dataclass(frozen=True)
class LaunchEnv:
    """Where the torchrun rendezvous happens and how many processes take part."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    multi_node: bool
    """True when a scheduler provided the rendezvous (MASTER_ADDR and friends)."""

    def world_size(self, nproc_per_node: int) -> int:
        from pai_cookbook.core.configs.model_config import ConfigError

        if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ConfigError(f"nproc_per_node={nproc_per_node!r}; give the number of processes on each machine, "
                              f"1 or more (the GPUs per node on a GPU machine).")
        return self.nnodes * nproc_per_node


def free_port() -> int:
    """A TCP port that is free on this machine now, below the kernel's ephemeral range where it can be.

    The launcher finds the port, then the rendezvous binds it a second or two later. A port from the
    ephemeral range (what `bind(0)` hands out) can be taken in between by any program's outgoing connection:
    seen in CI, two test sessions side by side, as EADDRINUSE in a worker. Outgoing connections never get a
    port below that range, so only another program choosing the same port in the same instant could.
    """
    low = _ephemeral_low()
    if low is not None and low > 2048:
        rng = random.Random()  # not the global generator: a seeded run must not pick the same port twice
        for _ in range(64):
            port = rng.randrange(max(1024, low - 12768), low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int | None:
    """The first port of Linux's ephemeral range (None elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def local_launch_env() -> LaunchEnv:
    """A rendezvous on this machine alone, whatever the scheduler set (jobs of a fixed small world)."""
    return LaunchEnv(nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=free_port(), multi_node=False)


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the scheduler's rendezvous variables, or make a single-machine rendezvous.

    Inside a torchrun worker (LOCAL_RANK set) WORLD_SIZE and RANK are process-level, not node-level,
    so they are not read as a scheduler's: a worker that launches its own sub-job stays on one machine.

    Raises:
        ValueError: when the scheduler variables are partial or malformed.
    """
    env = os.environ if environ is None else environ
    if "MASTER_ADDR" not in env or "LOCAL_RANK" in env:
        return local_launch_env()
    missing = [name for name in SCHEDULER_VARS[2:] if name not in env]
    if missing:
        raise ValueError(f"MASTER_ADDR is set ({env['MASTER_ADDR']}) but {missing} are not: a multi-node job "
                         f"needs WORLD_SIZE (number of nodes) and RANK (this node's index). Set them, or unset "
                         f"MASTER_ADDR to run on this machine alone.")
    try:
        nnodes, node_rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        port = int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    except ValueError as err:
        raise ValueError(f"scheduler variables must be integers: WORLD_SIZE={env['WORLD_SIZE']!r}, "
                         f"RANK={env['RANK']!r}, MASTER_PORT={env.get('MASTER_PORT')!r}") from err
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"RANK {node_rank} is outside [0, WORLD_SIZE={nnodes}); the scheduler's node index "
                         f"must be smaller than its node count.")
    return LaunchEnv(nnodes=nnodes, node_rank=node_rank, master_addr=env["MASTER_ADDR"], master_port=port,
                     multi_node=nnodes > 1)


def init_distributed(parallel: Any, seed: int, layers: str | None = None) -> DeviceInfo:
    """Join the torchrun process group and build Megatron-Core's parallel state (inside a worker).

    Workers call it through `worker.session`, which also tears it down.

    Args:
        parallel: a `config.ParallelConfig`; None joins the process group only (several layouts follow).
        seed: base seed; Megatron-Core derives distinct tensor-parallel streams from it.
        layers: the layer path the launcher decided for this job (job.json's "build"); None decides it here.
    Returns:
        The device this rank runs on.
    """
    device = detect_device() if layers is None else replace(detect_device(), layers=layers)
    if not device.is_cuda:  # before Megatron-Core is imported (compat imports it without compiling its fusions)
        from pai_cookbook.core.machine import compat
        compat.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.is_cuda:
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        # A world of one process has nobody to meet: an in-process store, no TCP port to bind (or to lose to
        # another program between the launcher choosing it and this line binding it).
        alone = {"store": torch.distributed.HashStore(), "rank": 0, "world_size": 1} \
            if int(os.environ.get("WORLD_SIZE", "1")) == 1 else {}
        # device_id binds NCCL to this rank's GPU (else each barrier warns that it guesses the device)
        torch.distributed.init_process_group(backend=device.backend, timeout=DIST_TIMEOUT,
                                             device_id=torch.device("cuda", local_rank) if device.is_cuda else None,
                                             **alone)
    if parallel is None:
        return device
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return device


def collective_device() -> torch.device:
    """Where a tensor handed to a collective must live inside a worker: this rank's GPU (NCCL takes nothing else) or
    the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    from pai_cookbook.core.machine import device_guard

    return device_guard.accelerator()  # the CPU, or the GPU the device guard emulates on it


def each_layout(layouts: Iterable[tuple[Any, int]], layers: str | None = None) -> Iterator[DeviceInfo]:
    """Megatron-Core's parallel state for each (ParallelConfig, seed) in turn, inside one process group.

    Several layouts in one launch (parity, generation and test runs) pay torchrun's and Megatron-Core's
    start-up once; the process group is joined on the first layout and kept, the parallel groups are
    rebuilt per layout. The caller's `destroy_distributed` ends the group. `layers`: as `init_distributed`'s (the
    session's device has them).
    """
    from megatron.core import parallel_state

    for parallel, seed in layouts:
        device = init_distributed(parallel, seed, layers)
        try:
            yield device
        finally:
            parallel_state.destroy_model_parallel()  # the next layout builds its own groups


def can_host_world_of_one() -> bool:
    """Whether this process can run a one-process job itself (`world_of_one`): no CUDA device, whose context would
    stay in a notebook kernel holding GPU memory, and no process group of its own already open here (it would be
    joined and then destroyed)."""
    return not torch.cuda.is_available() and not torch.distributed.is_initialized()


@contextlib.contextmanager
def world_of_one() -> Iterator[DeviceInfo]:
    """Megatron-Core's parallel state for one process at TP=PP=EP=1, in the caller's own process; torn down after.

    For jobs that only build a model on the meta device and move bytes (the streaming conversions): a worker
    process would spend seconds importing torch and Megatron-Core before its first byte (docs/megatron-core-on-cpu.md).
    The compatibility layer is applied here as in any CPU worker (building an MoE layer, even on the meta device,
    creates CUDA streams; its patches stand in only for CUDA calls that would raise on this machine). No port is
    bound (an in-process store). Yields the CPU's `DeviceInfo` (its layers as `build.choose_layers` decides on a CPU).
    Check `can_host_world_of_one()` first.
    """
    from pai_cookbook.core.machine import compat

    if not can_host_world_of_one():
        raise RuntimeError("world_of_one() needs a process without CUDA and without a process group of its own; "
                           "launch the job as a worker instead (core.launching.launch).")
    compat.apply()
    from megatron.core import parallel_state

    torch.distributed.init_process_group(backend="gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield detect_device()  # this process has no CUDA: the CPU, on the layers decided for it
    finally:
        destroy_distributed()


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def environment_report() -> dict[str, Any]:
    """Versions, device and what will run here: the first thing a notebook shows."""
    device = detect_device()
    versions = {}
    for dist in ("torch", "megatron-core", "transformers", "transformer-engine", "flash-attn"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    launch = detect_launch_env()
    record = build.record(device)
    runs_here = {
        "layers": {build.TE_LAYERS: "Transformer Engine", build.LOCAL_LAYERS: "Megatron-Core local (PyTorch)",
                   build.CPU_LAYERS: "Megatron-Core local + CPU converters"}[device.layers],
        "swaps": ", ".join(record["swaps"]),
        "cpu converters": ", ".join(record["cpu_converters"]) or "none",
        "fused kernels": ", ".join(record["fused_kernels"]) or "none",
        "backend": device.backend,
        "bf16": device.supports_bf16,
        "fp8 GEMMs": device.supports_fp8,
        "flash attention": device.has_flash_attn,
        "cpu compatibility layer": not device.is_cuda,
    }
    return {"python": platform.python_version(), "versions": versions, "device": asdict(device),
            "launch": asdict(launch) | {"kind": "multi-node job" if launch.multi_node else "single machine"},
            "runs_here": runs_here}
