"""The headline figures of a run of every notebook, as the README's companion page (docs/notebook-figures.md).

    python ci/run_notebooks.py --out outputs          # writes outputs/summary.json
    python ci/notebook_figures.py outputs/summary.json > docs/notebook-figures.md

Each notebook's minutes and the scalar figures it saved (`report.save_metrics`), as the run wrote them: the page is
made from a run, never typed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path


def _shown(value) -> str | None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None if isinstance(value, str) and len(value) > 60 else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return None  # lists and tables stay in metrics.json


def render(summary: dict, date: str, machine: str) -> str:
    lines = ["# What the notebooks printed: the last full run", "",
             f"Made by `ci/notebook_figures.py` from `outputs/summary.json` of a run of every notebook with its default "
             f"parameters ({date}; {machine}). Every figure is one the notebook's run saved in its `metrics.json`.", "",
             "| notebook | minutes |", "|---|---|"]
    lines += [f"| {name} | {entry['minutes']:.1f} |" for name, entry in summary.items()]
    for name, entry in summary.items():
        lines += ["", f"## {name}", "", "| figure | value |", "|---|---|"]
        lines += [f"| `{key}` | {shown} |" for key, value in entry.get("metrics", {}).items()
                  if (shown := _shown(value)) is not None]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    summary = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    sys.stdout.write(render(summary, datetime.date.today().isoformat(), machine))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
