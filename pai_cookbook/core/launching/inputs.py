"""What users hand the cookbook, read and checked in one place: files (JSON, text), lists, numbers, chat records.

Every check raises the caller's own error class (`error=`: `ConfigError` by default, `SFTError`, `DataError`) with
what was expected, what was found and the fix, so a bad input never surfaces as a `KeyError`, a `StopIteration`, a
`UnicodeDecodeError` without its file or a JSON error without its path. A string or a dict where a list belongs is
refused rather than iterated (a string would become one item per character, a dict its keys).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pai_cookbook.core.configs.model_config import ConfigError


def _file(path: str | Path, what: str, error: type[Exception]) -> Path:
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {path} is a folder; give the file inside it.")
    if not path.exists():
        raise error(f"{what} {path} does not exist; check the path (relative paths start at {Path.cwd()}).")
    return path


def not_utf8(where: str, data: bytes, start: int) -> str:
    """The message for text that is not UTF-8 at byte `start` of `data` (what the file is, how to convert it)."""
    return (f"{where}: not UTF-8 text (byte {data[start:start + 1]!r} at offset {start}); convert the file to UTF-8, "
            f"e.g. iconv -f GBK -t UTF-8 in.txt > out.txt.")


def read_text(path: str | Path, *, what: str = "file", error: type[Exception] = ConfigError) -> str:
    """The UTF-8 text of a file the user gave; a missing file, a folder or other bytes than UTF-8 (named with the
    line) are refused."""
    path = _file(path, what, error)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise error(not_utf8(f"{path}:{line}", data, err.start)) from None


def read_json(path: str | Path, *, fix: str, what: str = "file", error: type[Exception] = ConfigError) -> Any:
    """A JSON file's value; `fix` says how to make the file again when it is truncated or damaged (a write that was
    killed, a download cut short)."""
    path = _file(path, what, error)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path} is not valid JSON ({path.stat().st_size} bytes: {err}); it is truncated or damaged. "
                    f"{fix}") from None


def read_jsonl(path: str | Path, *, error: type[Exception] = ValueError) -> list[Any]:
    """The records of a JSONL log a run writes (metrics, evaluations, rollouts). A last line cut short (a launch
    killed while writing it) is left out with a warning: the records before it stand. Any other line that is not
    JSON is refused, naming it."""
    import warnings

    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                warnings.warn(f"{path}:{number}: the last record is cut short (a killed launch); it is left out.",
                              stacklevel=2)
                continue
            raise error(f"{path}:{number} is not valid JSON ({err.msg}); the run's log is damaged. Remove that line "
                        f"to read the rest.") from None
    return records


def listed(value: Any, name: str, item: str, *, error: type[Exception] = ConfigError) -> list[Any]:
    """`value` as a list: a list, tuple or other iterable of items; a string, bytes, a dict or None is refused."""
    if isinstance(value, (str, bytes, Path)):
        raise error(f"{name} must be a list of {item}; got one {type(value).__name__} ({str(value)[:60]!r}): pass "
                    f"[{str(value)[:60]!r}].")
    if isinstance(value, dict):
        raise error(f"{name} must be a list of {item}; got one dict (keys {sorted(value)[:6]}): pass [that dict].")
    if isinstance(value, (set, frozenset)):
        raise error(f"{name} must be a list of {item}; got a set, whose order changes from one process to the next "
                    f"(a resumed run would see another order): pass sorted(...) or a list.")
    if value is None or not isinstance(value, Iterable):
        raise error(f"{name} must be a list of {item}; got {value!r:.60}.")
    return list(value)


def integer(value: Any, name: str, *, minimum: int = 1, error: type[Exception] = ConfigError) -> int:
    """An int (not a bool, not a string of digits) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name}={value!r} must be an int >= {minimum} (found {type(value).__name__}); write it without "
                    f"quotes as a number.")
    if value < minimum:
        raise error(f"{name}={value} must be >= {minimum}.")
    return value


def number(value: Any, name: str, *, low: float, high: float, error: type[Exception] = ConfigError) -> float:
    """A finite int or float in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{name}={value!r} must be a number in [{low}, {high}) (found {type(value).__name__}).")
    if not low <= value < high:
        raise error(f"{name}={value} must lie in [{low}, {high}).")
    return float(value)


def messages(value: Any, where: str, *, error: type[Exception] = ConfigError,
             text_only: bool = True) -> list[dict[str, Any]]:
    """A chat: a non-empty list of {"role": str, "content": str}. With `text_only` False (a prompt for a chat template)
    a turn before the last may hold no text (None: an assistant turn that only calls a tool) or a list of parts; the
    last, which the model answers and errors quote, is text."""
    if not isinstance(value, list) or not value:
        raise error(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}}; found {value!r:.60}.")
    for number_, turn in enumerate(value, start=1):
        if not isinstance(turn, dict):
            raise error(f"{where}, message {number_}: expected {{\"role\", \"content\"}}, found {turn!r:.60}.")
        if not isinstance(turn.get("role"), str):
            raise error(f"{where}, message {number_} has no \"role\" (found {turn!r:.80}); give each message a role "
                        f"such as \"user\" or \"assistant\".")
        content = turn.get("content")
        if not isinstance(content, str) and (text_only or number_ == len(value) or
                                             not (content is None or isinstance(content, list))):
            raise error(f"{where}, message {number_} needs a string \"content\"; found {turn!r:.80}.")
    return value


def prompt_record(value: Any, where: str, *, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """A prompt as a record: a string becomes {"prompt": it}; a dict needs a string "prompt" or valid "messages"."""
    if isinstance(value, str):
        return {"prompt": value}
    if not isinstance(value, dict):
        raise error(f"{where} is {value!r:.60} ({type(value).__name__}); give a string, {{\"prompt\": \"...\"}} or "
                    f"{{\"messages\": [...]}}.")
    if "prompt" in value:
        if not isinstance(value["prompt"], str):
            raise error(f"{where}: \"prompt\" must be a string, found {value['prompt']!r:.60}.")
    elif "messages" in value:
        messages(value["messages"], where, error=error, text_only=False)
    else:
        raise error(f"{where} has neither \"prompt\" nor \"messages\" (its keys: {sorted(value)[:8]}).")
    return dict(value)


def prompt_text(record: dict[str, Any]) -> str:
    """A checked prompt record's text: its "prompt", or its last message (what errors quote)."""
    return record["prompt"] if "prompt" in record else record["messages"][-1]["content"]
