"""Catch host/device mix-ups on a CPU-only machine, where the host and the model's device are one.

On a GPU, `torch.tensor(left_padding)` (no device: the host) combined with the model's CUDA
activations fails with "Expected all tensors to be on the same device". On a CPU-only machine both
are the CPU and nothing fails. `DeviceGuard`, a `TorchFunctionMode`, tags each tensor it sees made as
"host" or "device" (the model's accelerator) and raises `DeviceMismatch` where CUDA would raise.
Values are computed for real, on the CPU; only the tags are emulated.

Rules, after CUDA's behaviour:
0. The emulated accelerator is `ACCELERATOR`, `torch.device("cpu", 0)`: the CPU under another name. A device
   tensor's `.device` is it, a host tensor's is `cpu`, and `torch.cuda.current_device()` returns it, so shared
   code that writes `device=x.device` or `device=torch.cuda.current_device()` lands where it would on a GPU.
1. Factories (torch.tensor, zeros, arange, rand, ..., from_numpy, range, and the legacy constructors
   `torch.LongTensor(...)` and kin) without `device=`, or with the plain CPU, make host tensors; with `ACCELERATOR`
   (or any CUDA device) device tensors.
   `torch.*_like(x)` and `x.new_*()` follow x's tag unless a device is given.
2. Any other op given both a host and a device tensor raises, except: host tensors of 0 dimensions
   (CUDA takes CPU scalars as operands, but not inside the tensor list of `stack`, `cat` and kin), `copy_`
   (cross-device copies are legal), `view_as`, `reshape_as` and `expand_as` (the other tensor gives its shape only;
   the output lives where the first does), and host tensors only in the index of `__getitem__`. `__setitem__` is a
   copy with a basic index (ints, slices: legal across devices) and `index_put_` with a tensor index: then the
   values must live where the indexed tensor does (0-dimensional ones excepted), and a device index cannot index a
   host tensor. Untagged tensors (made before entering, or where the guard cannot see) are wildcards.
3. Outputs are device if any input is device, else host if any input is host; an output that is one of
   the inputs (in-place ops, `out=`) keeps its own tag.
4. `x.cuda()` / `x.to(ACCELERATOR)` return a device-tagged alias (x keeps its tag), `x.to("cpu")` and
   `x.cpu()` a host-tagged one, `x.to(dtype)` keeps the tag; `.numpy()` of a device tensor raises.
5. `place(module)`, and `Module.cuda()` / `Module.to(device)` while active, tag parameters and buffers as device.
6. The torch.distributed tensor collectives refuse host tensors (NCCL takes device tensors only), except inside the
   object collectives, which make their own host tensors on gloo.
7. The error names the op and where the host tensor was made (first frame in the package or its tests, else the
   first frame outside torch), carried from a tensor to what is derived from it.

What it cannot see: ops run by autograd's backward and ops inside C++ (their outputs stay untagged), tensors made by
functions imported by name before entering (`from torch import from_numpy`), `torch.Tensor(...)` called as a
constructor (the class cannot be replaced), and collectives called through names bound before entering. The guard is
not reentrant.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

ENV = "PAI_COOKBOOK_DEVICE_GUARD"
"""Set to "1" for `from_environment()` to return an active guard."""
HOST, DEVICE = "host", "device"
ACCELERATOR = torch.device("cpu", 0)
"""The emulated GPU: the CPU under another name (rule 0 of the module doc)."""

_FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
                        "rand", "randn", "randint", "randperm", "empty_strided", "tril_indices", "triu_indices"})
# Factories that bypass torch function modes: patched on the torch module while the guard is active.
_UNSEEN_FACTORIES = ("from_numpy", "range")
# The legacy typed constructors (`torch.LongTensor([1, 2])`: a host tensor on every machine), likewise patched.
_LEGACY_CONSTRUCTORS = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
                        "ShortTensor", "IntTensor", "LongTensor", "BoolTensor")
# Ops whose tensor list must live on one device, 0-dimensional members included (no CPU-scalar exception).
_TENSOR_LISTS = frozenset({"stack", "cat", "concat", "concatenate", "hstack", "vstack", "dstack", "column_stack"})
_MOVES = frozenset({"to", "cpu", "cuda"})
_TO_NUMPY = frozenset({"numpy", "__array__"})
_UNCHECKED = frozenset({"copy_"})
# Ops that read their other tensor's shape only (`x.view_as(y)` is `x.view(y.size())`): legal, output where `x` is.
_SHAPE_OF_OTHER = frozenset({"view_as", "reshape_as", "expand_as"})
_ALIASING_PROPERTIES = frozenset({"data", "grad", "T", "mT", "H", "mH"})
_TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce", "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single")
_OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
_MISSING = object()


def _where(device: Any) -> str:
    """The tag a tensor made or moved to `device` gets: DEVICE for the accelerator (or CUDA), HOST for the CPU."""
    device = torch.device(device) if not isinstance(device, int) else ACCELERATOR
    return DEVICE if device.type != "cpu" or device.index is not None else HOST

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Frames in these folders name the creation site first; the trailing separator keeps siblings out.
_OWN_FOLDERS = tuple(os.path.join(_REPO_ROOT, name) + os.sep for name in ("pai_cookbook", "tests"))
_TORCH_FOLDER = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = __file__


class DeviceMismatch(RuntimeError):
    """A host tensor met the model's device where CUDA would refuse it."""


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts, in order: what op arguments and results hold.

    Not torch's pytree: its tree_flatten tripled the time of a small model's forward pass.
    """
    found, stack = [], [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def _creation_site() -> str | None:
    """'path:line in function' of the caller that made a tensor: the innermost frame in the package or
    its tests, else the innermost frame outside torch; paths relative to the repository root."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != _THIS_FILE:
            if filename.startswith(_OWN_FOLDERS):
                fallback = frame
                break
            if fallback is None and not filename.startswith(_TORCH_FOLDER):
                fallback = frame
        frame = frame.f_back
    if fallback is None:
        return None
    path = fallback.f_code.co_filename
    if path.startswith(_REPO_ROOT + os.sep):
        path = os.path.relpath(path, _REPO_ROOT)
    return f"{path}:{fallback.f_lineno} in {fallback.f_code.co_name}"


class DeviceGuard(TorchFunctionMode):
    """`with DeviceGuard() as guard: guard.place(model); ...` raises `DeviceMismatch` where CUDA would.

    `tags` maps tensors to HOST or DEVICE, `sites` host tensors to where they were made; `ops_checked`
    counts the ops the guard checked.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.sites: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.ops_checked = 0
        self._saved: list[tuple[Any, str, Any]] = []
        self._object_depth = 0

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """Tag every parameter and buffer of `module` as on the device, as `module.cuda()` puts them."""
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            self.tags[tensor] = DEVICE
        return module

    # --- entering and leaving: patches of what the mode cannot see ------------------------------
    def __enter__(self) -> DeviceGuard:
        global _active
        try:
            self._patch_all()
        except BaseException:
            self._restore()
            raise
        _active = self
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        global _active
        try:
            super().__exit__(*exc_info)
        finally:
            _active = None
            self._restore()

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, new)

    def _restore(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    def _patch_all(self) -> None:
        guard, module_cuda, module_to = self, torch.nn.Module.cuda, torch.nn.Module.to

        def placed_cuda(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            result = module_cuda(module, *args, **kwargs)
            guard.place(module)
            return result

        def placed_to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
            result = module_to(module, *args, **kwargs)
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None and _where(device) == DEVICE:
                guard.place(module)
            return result

        self._patch(torch.nn.Module, "cuda", placed_cuda)
        self._patch(torch.nn.Module, "to", placed_to)
        # Not the real Tensor.cuda (no CUDA here), nor compat's `return self`: the mode's move to the device.
        self._patch(torch.Tensor, "cuda", lambda tensor, *args, **kwargs: tensor.to(ACCELERATOR))
        self._patch(torch.cuda, "current_device", lambda: ACCELERATOR)
        for name in _UNSEEN_FACTORIES:
            self._patch(torch, name, self._host_factory(getattr(torch, name)))
        for name in _LEGACY_CONSTRUCTORS:
            self._patch(torch, name, _LegacyConstructor(getattr(torch, name), self))
        if torch.distributed.is_available():
            c10d = torch.distributed.distributed_c10d
            for names, wrap in ((_TENSOR_COLLECTIVES, self._checked), (_OBJECT_COLLECTIVES, self._unchecked)):
                for name in names:
                    original = getattr(torch.distributed, name)
                    wrapped = wrap(name, original)
                    self._patch(torch.distributed, name, wrapped)
                    if getattr(c10d, name, None) is original:  # what the object collectives call inside
                        self._patch(c10d, name, wrapped)

    def _host_factory(self, factory: Any) -> Any:
        @functools.wraps(factory)
        def made_on_host(*args: Any, **kwargs: Any) -> torch.Tensor:
            result = factory(*args, **kwargs)
            tag = HOST if kwargs.get("device") is None else _where(kwargs["device"])
            self._tag(result, tag, _creation_site() if tag == HOST else None)
            return result
        return made_on_host

    def _checked(self, name: str, collective: Any) -> Any:
        @functools.wraps(collective)
        def device_only(*args: Any, **kwargs: Any) -> Any:
            if not self._object_depth:
                for leaf in _tensors((args, kwargs)):
                    if self.tags.get(leaf) == HOST:
                        raise DeviceMismatch(self._message(name, leaf, "hands NCCL (it takes only the model's device, "
                                                                       "cuda:0 on a GPU)"))
            return collective(*args, **kwargs)
        return device_only

    def _unchecked(self, name: str, collective: Any) -> Any:
        @functools.wraps(collective)
        def own_host_tensors(*args: Any, **kwargs: Any) -> Any:
            self._object_depth += 1
            try:
                return collective(*args, **kwargs)
            finally:
                self._object_depth -= 1
        return own_host_tensors

    # --- the mode ----------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The mode is popped while this runs: calls made here are not intercepted again.
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            result = func(*args)
            if isinstance(result, torch.device) and self.tags.get(args[0]) == DEVICE:
                return ACCELERATOR  # `x.device` of a device tensor: where `device=x.device` must make tensors
            if getattr(func.__self__, "__name__", None) in _ALIASING_PROPERTIES and isinstance(result, torch.Tensor) \
                    and result not in self.tags and args[0] in self.tags:
                self._tag(result, self.tags[args[0]], self.sites.get(args[0]))
            return result
        if name == "__set__":
            func(*args)
            # `x.data = y` makes x live where y does
            if getattr(func.__self__, "__name__", None) == "data" and args[1] in self.tags:
                self._tag(args[0], self.tags[args[1]], self.sites.get(args[1]))
            return None
        self.ops_checked += 1
        if name in _MOVES:
            return self._move(name, func, args, kwargs)
        if name in _TO_NUMPY and self.tags.get(args[0]) == DEVICE and not kwargs.get("force"):
            raise DeviceMismatch("can't convert cuda:0 device type tensor to numpy (a tensor on the model's device, "
                                 "emulated by DeviceGuard). Use Tensor.cpu() to copy the tensor to host memory first.")
        tensors = _tensors((args, kwargs))
        if name in _SHAPE_OF_OTHER:
            tensors = tensors[:1]
        tags = [self.tags.get(tensor) for tensor in tensors]
        if name == "__setitem__":
            self._check_setitem(*args[:3])
        elif DEVICE in tags and name not in _UNCHECKED:
            # __getitem__: a host index into a device tensor is fine; a host tensor indexed is not.
            suspects = tensors[:1] if name == "__getitem__" else tensors
            scalars_pass = name not in _TENSOR_LISTS
            for tensor, tag in zip(suspects, tags):
                if tag == HOST and (tensor.dim() > 0 or not scalars_pass):
                    raise DeviceMismatch(self._message(name, tensor, "mixes the model's device (cuda:0 on a GPU) with"))
        result = func(*args, **kwargs)
        if kwargs.get("device") is not None:
            tag = _where(kwargs["device"])
            site = _creation_site() if tag == HOST else None
        elif DEVICE in tags:
            tag, site = DEVICE, None
        elif HOST in tags:
            tag, site = HOST, next((self.sites[t] for t, g in zip(tensors, tags) if g == HOST and t in self.sites), None)
        elif not tensors and name in _FACTORIES and getattr(func, "__module__", None) == "torch":
            tag, site = HOST, _creation_site()
        else:
            return result
        inputs = {id(tensor) for tensor in tensors}
        for out in _tensors(result):
            if id(out) not in inputs:
                self._tag(out, tag, site)
        return result

    def _check_setitem(self, target: torch.Tensor, index: Any, value: Any) -> None:
        """`target[index] = value`: with a tensor index it is `index_put_`, whose values must live where `target` does
        (a 0-dimensional one is moved) and whose index may be host or `target`'s device; with a basic index, a copy."""
        indices = [t for t in _tensors(index) if t.dim() > 0]  # a 0-dim integer index selects, as an int does
        where = self.tags.get(target)
        if not indices or where is None:
            return
        if isinstance(value, torch.Tensor) and value.dim() > 0 and self.tags.get(value) not in (None, where):
            raise DeviceMismatch(self._message("__setitem__ (index_put_)", value if where == DEVICE else target,
                                               "with a tensor index mixes the model's device (cuda:0 on a GPU) with"))
        if where == HOST and any(self.tags.get(t) == DEVICE for t in indices):
            raise DeviceMismatch(self._message("__setitem__ (index_put_)", target, "indexes by a device tensor (indices "
                                               "must be on the CPU or on the indexed tensor's device)"))

    def _move(self, name: str, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """`.to` / `.cpu` / `.cuda`: a tensor with the target's tag, an alias where the values stay put."""
        tensor, current = args[0], self.tags.get(args[0])
        if name == "cpu":
            target = HOST
        elif name == "cuda":
            target = DEVICE
        else:
            other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get("other")
            if other is not None:
                target = self.tags.get(other)
            else:
                device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
                target = None if device is None else _where(device)
        result = tensor if name == "cuda" else func(*args, **kwargs)  # no CUDA to move to here
        if target is None or target == current:
            if result is not tensor and current is not None:
                self._tag(result, current, self.sites.get(tensor))
            return result
        if result is tensor:  # an alias, not self: the original keeps its own tag
            result = tensor.view_as(tensor)
        self._tag(result, target, _creation_site() if target == HOST else None)
        return result

    def _tag(self, tensor: torch.Tensor, tag: str, site: str | None) -> None:
        self.tags[tensor] = tag
        if site is not None:
            self.sites[tensor] = site

    def _message(self, op: str, host: torch.Tensor, what: str) -> str:
        site = self.sites.get(host)
        made = f"made at {site}" if site else "made where the guard could not see"
        return (f"Expected all tensors to be on the same device: {op} {what} a host tensor of shape "
                f"{tuple(host.shape)} {made} (cpu on a GPU): make it on the model's device (device=x.device)")


class _LegacyConstructor:
    """`torch.LongTensor` and kin while a guard is active: what they make is a host tensor, tagged with where it was
    made; `isinstance` and unions (annotations evaluated at runtime) still mean the real type."""

    def __init__(self, legacy: Any, guard: DeviceGuard) -> None:
        self.legacy, self.guard = legacy, guard

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.legacy(*args, **kwargs)
        self.guard._tag(result, HOST, _creation_site())
        return result

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, self.legacy)

    def __or__(self, other: Any) -> Any:
        return self.legacy | other

    def __ror__(self, other: Any) -> Any:  # `int | torch.IntTensor`: transformers' annotations, evaluated at import
        return other | self.legacy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.legacy, name)


_active: DeviceGuard | None = None
"""The guard entered in this process, if any (`place` reads it)."""


def place(module: torch.nn.Module) -> torch.nn.Module:
    """Where a guard is active, tag `module`'s parameters and buffers as on the device (what `module.cuda()` does on
    a GPU; `core.modeling.model.build_model` calls it on a CPU); elsewhere nothing. Returns `module`."""
    return module if _active is None else _active.place(module)


def accelerator() -> torch.device:
    """Where shared code puts tensors for a collective or the model on a machine without CUDA: the CPU, or
    `ACCELERATOR` while a guard emulates a GPU (`core.machine.runtime.collective_device`)."""
    return torch.device("cpu") if _active is None else ACCELERATOR


def from_environment() -> contextlib.AbstractContextManager:
    """A `DeviceGuard` when the environment variable ENV is "1", else a context that does nothing."""
    return DeviceGuard() if os.environ.get(ENV) == "1" else contextlib.nullcontext()
