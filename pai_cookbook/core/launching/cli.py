"""How every `python -m pai_cookbook.<recipe>` command ends, in a batch job's terms: exit 0 with the result on
standard output; 2 on bad input, refused with the fix before any worker started (or, for a conversion that runs in
this process, by the conversion itself: a weight holding NaN), with nothing kept; 1 when a worker failed or a
timeout ended it (the message names the failing rank and its log tail)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
"""The cookbook's refusals (ConfigError, SFTError and DataError are ValueErrors) and a path that cannot be used."""


def print_json(result: Any) -> None:
    if isinstance(result, dict):
        result = {k: v for k, v in result.items() if k != "events"}  # the progress events were shown as they came
    print(json.dumps(result, indent=2, ensure_ascii=False))


def finish(prog: str, work: Callable[[], Any], report: Callable[[Any], None] = print_json) -> int:
    """Run a command's `work` and turn how it ended into the exit status (the module docstring's three)."""
    from pai_cookbook.core.launching.launch import WorkerError

    try:
        result = work()
    except (WorkerError, TimeoutError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    except BAD_INPUT as err:
        print(f"{prog}: bad input: {err}", file=sys.stderr)
        return 2
    report(result)
    return 0
