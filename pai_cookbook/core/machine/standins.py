"""CPU stand-ins for the CUDA objects Megatron-Core reaches for; `core.machine.compat` puts them in place.

Each is the honest CPU equivalent of its CUDA counterpart, not a fake of another program: CPU ops run
in program order (so a stream's waits and syncs have nothing to wait for), an event's time is the
wall clock when `record` returns, tensors Megatron-Core would create on "cuda" are created where the
model lives, and without Transformer Engine FP8 is never enabled.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from pai_cookbook.core.machine import device_guard


def is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal in torch's API
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")



class CpuTorch(types.ModuleType):
    """`torch` as seen by one Megatron module: tensor factories map device='cuda' to the CPU."""

    def __init__(self, factories: tuple[str, ...]) -> None:
        super().__init__("torch")
        for name in factories:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    @staticmethod
    def _cpu_factory(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def wrapper(*args, **kwargs):
            if is_cuda_device(kwargs.get("device")):
                kwargs["device"] = device_guard.accelerator()  # the CPU (a GPU's stand-in under the device guard)
            return factory(*args, **kwargs)
        return wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class NullStream:
    """A CUDA stream/event stand-in: CPU ops run in program order, so waits and syncs are no-ops.

    There is one CPU "stream": all instances compare equal (code that asks "am I on a side stream?"
    gets no), and every method (wait_stream, record_event, synchronize, ...) returns another stand-in.
    """

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NullStream)

    def __hash__(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Callable:
        return lambda *args, **kwargs: NullStream()

    def query(self) -> bool:
        return True


class CpuEvent(NullStream):
    """A CUDA event stand-in that keeps time: Megatron-Core's static inference controller records an
    event per generated token and reads `elapsed_time` (milliseconds) as a number for its per-token
    latencies; on CPU, work is done when `record` returns, so a wall-clock stamp is the event time."""

    def __init__(self, *args, **kwargs) -> None:
        self.time_s: float | None = None

    def record(self, *args, **kwargs) -> None:
        self.time_s = time.perf_counter()

    def elapsed_time(self, end: CpuEvent) -> float:
        if self.time_s is None or end.time_s is None:
            raise RuntimeError("elapsed_time needs both events recorded (call record() on each first).")
        return (end.time_s - self.time_s) * 1e3


class NoFP8:
    """Without Transformer Engine FP8 is never enabled; answers the two questions recompute asks."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


@contextlib.contextmanager
def cuda_type_names():
    """While active, `t.type()` reports 'torch.cuda.FloatTensor' for a CPU float tensor, etc."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        # once: under a TorchFunctionMode (core.machine.device_guard) `original` is dispatched to this function again
        cpu = self.device.type == "cpu" and not name.startswith("torch.cuda.")
        return name.replace("torch.", "torch.cuda.", 1) if cpu else name

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)
    return wrapper
