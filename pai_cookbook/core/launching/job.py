"""A job: what one launch runs, a dataclass that travels to its workers as JSON and comes back whole.

`Job` is the base of every job (`RunConfig`, `ConvertJob`, `GenerationBatch`, ...); `from_dict` rebuilds one (and
its nested sections) from its JSON, refusing unknown fields and values of the wrong type by name, before any worker
starts. Nothing here knows a particular job: `core.configs.config` defines the training run, `core.launching.jobs` the others.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pai_cookbook.core.configs.model_config import ConfigError, require

J = TypeVar("J", bound="Job")
BUILD_KEY = "build"
"""job.json's record of what the launcher decided to build (`core.machine.build.record`), beside the job's fields."""


class Job:
    """Base of every worker's job: a `@dataclass(kw_only=True)` that travels to the workers as JSON.

    A subclass names the module torchrun runs (`WORKER`) and may check itself against the world it
    will run in (`check`), which `core.launching.launch` calls before any process starts.
    """

    WORKER: ClassVar[str]
    """Module (or .py path) whose `main` is `worker.entry(ThisJob)(...)`."""
    SPANS_NODES: ClassVar[bool] = False
    """True for jobs whose world grows with the nodes of a multi-node job (training); False for jobs of
    a fixed world (conversion, parity, generation), which node 0 runs alone."""
    REPEATED_STEPS: ClassVar[bool] = False
    """True for jobs that run steps of the same shapes many times (training, RL, reward models): on a CPU the
    launcher has glibc keep freed memory for the next step (`core.launching.launch.KEEP_FREED_MEMORY`)."""

    def check(self, world_size: int, device: Any) -> None:
        """Raise ConfigError if this job cannot run on `world_size` processes of `device`."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls: type[J], text: str) -> J:
        return cls.planned_from_json(text)[0]

    @classmethod
    def planned_from_json(cls: type[J], text: str) -> tuple[J, dict[str, Any] | None]:
        """The job of a job.json, and the launcher's build plan in it (not a field; None in one written by hand)."""
        data = json.loads(text)
        build = data.pop(BUILD_KEY, None) if isinstance(data, dict) else None
        return from_dict(cls, data), build

    def save(self, path: str | Path, build: dict[str, Any] | None = None) -> Path:
        """Write the job as JSON; the launcher adds its build plan (`core.machine.build.record`) under `BUILD_KEY`."""
        path = Path(path)
        path.write_text(self.to_json() if build is None else
                        json.dumps(dataclasses.asdict(self) | {BUILD_KEY: build}, indent=2))
        return path

    @classmethod
    def load(cls: type[J], path: str | Path) -> J:
        return cls.load_planned(path)[0]

    @classmethod
    def load_planned(cls: type[J], path: str | Path) -> tuple[J, dict[str, Any] | None]:
        """`planned_from_json` of the file at `path`, read once; its faults named with the fix."""
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"{path} is a folder; give the {cls.__name__} JSON file (run.json) inside it.")
        try:
            return cls.planned_from_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist; write it with {cls.__name__}(...).save(path).") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path} is not valid JSON ({err}); write it with {cls.__name__}(...).save(path).") \
                from None


def _check_type(owner: str, name: str, hint: Any, value: Any) -> Any:
    """Rebuild one field from JSON: nested dataclasses (also in lists and optionals); scalars type-checked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        require(isinstance(value, dict), f"{owner}.{name} must be an object of {hint.__name__} fields, got {value!r}.")
        return from_dict(hint, value)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(owner, name, inner[0], value) if len(inner) == 1 else value
    if origin in (list, tuple) and args:
        require(isinstance(value, list), f"{owner}.{name} must be a list, got {value!r}.")
        return [_check_type(owner, f"{name}[{i}]", args[0], v) for i, v in enumerate(value)]
    if hint in (int, float, str, bool):
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
        ok = ok or (hint is float and isinstance(value, int) and not isinstance(value, bool))
        require(ok, f"{owner}.{name} must be {hint.__name__}, got {value!r} ({type(value).__name__}); "
                     f"write it without quotes{' as a number' if hint in (int, float) else ''}.")
    return value


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a (nested) config or job dataclass from `dataclasses.asdict` output.

    Unknown keys and values of the wrong type are ConfigErrors naming the field, not tracebacks from
    deep inside a worker.
    """
    require(isinstance(data, dict), f"{cls.__name__} must be a JSON object of its fields, got {type(data).__name__}.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - names
    require(not unknown, f"{cls.__name__} has no field(s) {sorted(unknown)}; known: {sorted(names)}.")
    return cls(**{key: _check_type(cls.__name__, key, hints[key], value) for key, value in data.items()})


def decided(job: J, device: Any) -> tuple[J, Any]:
    """`job` and `device` (a `runtime.DeviceInfo`) with every choice that depends on the machine made here, once:
    each nested section that has a `decided(device)` method (`FP8Config`: its backend) is replaced by what that
    returns, in dataclasses and lists alike; then each section that has `narrow_layers(layers)` (emulated FP8: the
    local spec's linears) narrows the device's layer path (`core.machine.build`). The launcher calls it before the
    job's check and writes both into job.json, so the workers read one answer instead of deciding again."""
    job = _decide(job, device)
    layers = device.layers
    for section in _sections(job):
        narrow = getattr(section, "narrow_layers", None)
        if callable(narrow):
            layers = narrow(layers)
    return job, (device if layers == device.layers else dataclasses.replace(device, layers=layers))


def _sections(value: Any) -> Iterator[Any]:
    if isinstance(value, list):
        for v in value:
            yield from _sections(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield value
        for f in dataclasses.fields(value):
            yield from _sections(getattr(value, f.name))


def _decide(value: Any, device: Any) -> Any:
    if isinstance(value, list):
        return [_decide(v, device) for v in value]
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    if callable(getattr(value, "decided", None)):
        return value.decided(device)
    changes = {f.name: _decide(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
    changed = {k: v for k, v in changes.items() if v is not getattr(value, k)}
    return dataclasses.replace(value, **changed) if changed else value
