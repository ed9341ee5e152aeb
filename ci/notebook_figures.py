"""The headline figures of a run of every notebook, as the README's companion page (docs/notebook-figures.md).

    python ci/run_notebooks.py --out outputs          # writes outputs/summary.json
    python ci/notebook_figures.py outputs/summary.json > docs/notebook-figures.md
    python ci/notebook_figures.py a/summary.json b/summary.json > ...   # runs of some notebooks each
    python ci/notebook_figures.py outputs/summary.json --tiny tiny/summary.json > ...  # and runs with --tiny

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
    if isinstance(value, str):  # a path of the run's machine says nothing here
        return None if "/" in value or len(value) > 60 else value
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return None  # lists and tables stay in metrics.json


def render(summary: dict, date: str, machine: str, remark: str = "") -> str:
    tiny = any(name.endswith("(tiny)") for name in summary)
    lines = ["# What the notebooks printed: the last full run", "",
             "Made by `ci/notebook_figures.py` from `outputs/summary.json` of a run of every notebook with its default "
             "parameters" + (", and of the notebooks CI runs on tiny models with those parameters (\"(tiny)\": "
                              "`ci/run_notebooks.py --tiny`)" if tiny else "")
             + f" ({date}; {machine}). Every figure is one the notebook's run saved in its `metrics.json`."
             + (f" {remark}" if remark else ""), "",
             "| notebook | minutes |", "|---|---|"]
    lines += [f"| {name} | {entry['minutes']:.1f} |" for name, entry in summary.items()]
    for name, entry in summary.items():
        lines += ["", f"## {name}", "", "| figure | value |", "|---|---|"]
        lines += [f"| `{key}` | {shown} |" for key, value in entry.get("metrics", {}).items()
                  if (shown := _shown(value)) is not None]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """argv: summary.json files (later ones add or replace notebooks); `--tiny FILE` adds a summary of a run with
    `ci/run_notebooks.py --tiny` (its notebooks listed as "(tiny)"); `--remark "..."` a sentence under the title."""
    remark = argv[argv.index("--remark") + 1] if "--remark" in argv else ""
    tiny = [argv[i + 1] for i, a in enumerate(argv) if a == "--tiny"]
    options = {i + 1 for i, a in enumerate(argv) if a in ("--remark", "--tiny")}
    files = [a for i, a in enumerate(argv) if a not in ("--remark", "--tiny") and i not in options]
    summary: dict = {}
    for name in files:
        summary.update(json.loads(Path(name).read_text(encoding="utf-8")))
    for name in tiny:
        summary.update({f"{stem} (tiny)": entry for stem, entry in json.loads(Path(name).read_text(encoding="utf-8")).items()})
    summary = dict(sorted(summary.items()))
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    sys.stdout.write(render(summary, datetime.date.today().isoformat(), machine, remark))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
