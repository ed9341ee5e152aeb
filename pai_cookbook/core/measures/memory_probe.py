"""What a training rank actually holds, counted from the tensors themselves: the measurement `plan` is checked against.

Four components, each in bytes, each counting every storage once (by `untyped_storage().data_ptr()`), so views,
shards and buffers that alias each other are not counted twice:
- `weights`: the storages of every parameter of the rank's model chunks (with Megatron-Core's distributed optimizer
  the parameters are views of DDP's param buffer, whose padding is counted with it);
- `gradients`: the storages of every parameter's `main_grad` (DDP's grad buffers, padding included) and any `.grad`;
- `optimizer`: every tensor the optimizer keeps that is not a weight or a gradient storage: Adam's exp_avg and
  exp_avg_sq, fp32 main copies of bf16 weights (whole, or this rank's shards with the distributed optimizer), step
  counters. Read after an optimizer step, when the states exist;
- `activations`: the peak, over a step's forward and backward, of the bytes autograd holds for backward
  (`torch.autograd.graph.saved_tensors_hooks`): a storage is live from the first time it is saved until the last
  graph node that saved it lets it go; weights and gradients saved by a matmul are not activations. The peak is over
  every micro-batch the pipeline schedule has in flight, and over the recomputation of a checkpointed layer in
  backward. Tensors that live only while an operator runs (workspace, the logits before the loss takes them) are not
  saved for backward and are not counted.

`MemoryProbe.gather` returns every rank's figures to every rank (a collective: all ranks call it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint

COMPONENTS = ("weights", "gradients", "optimizer", "activations")


def _key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _unique_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> tuple[int, set[int]]:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        ptr, nbytes = _key(t)
        if ptr and ptr not in exclude:
            seen[ptr] = nbytes
    return sum(seen.values()), set(seen)


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor under the optimizer's states and param groups (chained and distributed optimizers included)."""
    for inner in checkpoint.chained_optimizers(optimizer):
        torch_opt = getattr(inner, "optimizer", inner)
        for state in torch_opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for group in torch_opt.param_groups:
            yield from group["params"]
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(inner, name, None) or []:
                yield from (p for p in group if isinstance(p, torch.Tensor))


class MemoryProbe:
    """Counts one rank's weights, gradients, optimizer state and peak saved activations (see the module)."""

    def __init__(self, record: bool = False):
        self.peak_activations = 0
        self.held: dict[str, int] = {}
        self.record = record
        """Keep (bytes, shape, dtype) of every storage live at the peak, to show what makes it up."""
        self.at_peak: list[tuple[int, tuple[int, ...], str]] = []
        self._live: dict[int, list] = {}  # storage ptr -> [refcount, nbytes, shape, dtype]
        self._bytes = 0
        self._exclude: set[int] = set()
        self._modules: list[str] = []

    @contextlib.contextmanager
    def activations(self, model: list[torch.nn.Module]) -> Iterator[None]:
        """Count what autograd saves while the body runs (one step's forward and backward over `model`'s chunks)."""
        self._exclude = _model_storages(model)
        probe = self

        class Saved:
            __slots__ = ("tensor", "ptr")

            def __init__(self, tensor: torch.Tensor):
                self.tensor = tensor.detach()  # no grad_fn: an output saved by its own node makes no cycle
                ptr, nbytes = _key(tensor)
                self.ptr = ptr if ptr and ptr not in probe._exclude else 0
                if self.ptr:
                    entry = probe._live.get(ptr)
                    if entry is None:
                        where = probe._modules[-1] if probe._modules else ""
                        probe._live[ptr] = [1, nbytes, tuple(tensor.shape), f"{tensor.dtype} {where}"]
                        probe._bytes += nbytes
                        if probe._bytes > probe.peak_activations:
                            probe.peak_activations = probe._bytes
                            if probe.record:
                                probe.at_peak = [(e[1], e[2], e[3]) for e in probe._live.values()]
                    else:
                        entry[0] += 1

            def __del__(self):
                if self.ptr:
                    entry = probe._live[self.ptr]
                    entry[0] -= 1
                    if entry[0] == 0:
                        del probe._live[self.ptr]
                        probe._bytes -= entry[1]

        with torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor), self._module_names():
            yield

    @contextlib.contextmanager
    def _module_names(self) -> Iterator[None]:
        """With `record`: the class of the module running when a storage is first saved, kept beside it."""
        if not self.record:
            yield
            return
        from torch.nn.modules import module as nn_module

        pre = nn_module.register_module_forward_pre_hook(lambda m, args: self._modules.append(type(m).__name__))
        post = nn_module.register_module_forward_hook(lambda m, args, out: self._modules.pop() and None)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def after_step(self, model: list[torch.nn.Module], optimizer: Any) -> None:
        """Count the weights, gradient buffers and optimizer state `model` and `optimizer` hold now."""
        params = [p for chunk in model for p in chunk.parameters()]
        weights, weight_ptrs = _unique_bytes(params)
        grads, grad_ptrs = _unique_bytes([getattr(p, "main_grad", None) for p in params] + [p.grad for p in params],
                                         exclude=weight_ptrs)
        state, _ = _unique_bytes(_optimizer_tensors(optimizer), exclude=weight_ptrs | grad_ptrs)
        self.held = {"weights": weights, "gradients": grads, "optimizer": state}

    def report(self) -> dict[str, Any]:
        """This rank's figures: bytes per component (`COMPONENTS`) and, with `record`, the storages at the peak."""
        out: dict[str, Any] = dict(self.held) | {"activations": self.peak_activations}
        if self.record:
            out["at_peak"] = sorted(self.at_peak, reverse=True)
        return out

    def gather(self) -> list[dict[str, Any]]:
        """Every rank's `report`, in rank order, on every rank (all ranks must call it)."""
        reports: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(reports, self.report())
        return reports


def _model_storages(model: list[torch.nn.Module]) -> set[int]:
    """Storages of the model's parameters, buffers and gradient buffers: what a saved tensor aliasing them is not."""
    tensors: list[torch.Tensor] = []
    for chunk in model:
        for p in chunk.parameters():
            tensors += [p, getattr(p, "main_grad", None)]
        tensors += list(torch.nn.Module.buffers(chunk))  # DDP has its own `buffers` attribute
    return _unique_bytes(tensors)[1]
