"""What a notebook tells its reader and its tests: environment tables, parity figures, metrics.json.

Every notebook ends by writing its headline figures to OUTPUT_DIR/metrics.json; the notebook tests
read that file and assert on it with explicit tolerances.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"


def environment_markdown(report: dict[str, Any]) -> str:
    """`runtime.environment_report()` as a Markdown table for `IPython.display.Markdown`."""
    device = report["device"]
    rows = [("Python", report["python"]), ("device", device["name"]), ("backend", device["backend"]),
            ("launch", f"{report['launch']['kind']} ({report['launch']['nnodes']} node(s))")]
    rows += [(name, version or "not installed") for name, version in report["versions"].items()]
    rows += [(f"runs here: {what}", _yes_no(value)) for what, value in report["runs_here"].items()]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _yes_no(value: Any) -> str:
    return {True: "yes", False: "no (needs a GPU)"}.get(value, str(value))


def compare_curves(reference: Sequence[float], other: Sequence[float]) -> dict[str, float]:
    """Step-by-step agreement of two loss curves of equal length."""
    if len(reference) != len(other):
        raise ValueError(f"curves differ in length: {len(reference)} vs {len(other)} steps")
    diffs = [abs(a - b) for a, b in zip(reference, other)]
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs), "steps": len(diffs)}


def speed_comparison(runs: Mapping[str, Sequence[float]], skip: int = 2) -> dict[str, Any]:
    """Which of two runs was faster, from their per-step tokens/s (`train.history(run_dir)["tokens_per_s"]`): each
    run's median after its first `skip` steps (start-up: first calls, caches) and its middle half (the quartiles). A
    verdict only where the middle halves do not overlap; on a shared machine, load moves single steps by several times,
    and a mean of them says more about the load than about the layout.

    Returns {"runs": {name: {"median", "low", "high"}}, "ratio" (second median / first), "verdict" (the faster name,
    or None), "sentence"}."""
    import statistics

    if len(runs) != 2:
        raise ValueError(f"speed_comparison compares two runs; got {len(runs)} ({sorted(runs)}).")
    figures = {}
    for name, rates in runs.items():
        kept = list(rates)[skip:]
        if len(kept) < 4:
            raise ValueError(f"{name}: {len(kept)} steps after the first {skip}; a median and quartiles need 4 or more.")
        low, _, high = statistics.quantiles(kept, n=4)
        figures[name] = {"median": statistics.median(kept), "low": low, "high": high}
    (a, fa), (b, fb) = figures.items()
    ratio = fb["median"] / fa["median"]
    apart = fa["high"] < fb["low"] or fb["high"] < fa["low"]
    verdict = (b if ratio > 1 else a) if apart else None
    shown = "; ".join(f"{n}: median {f['median']:,.0f} tokens/s (middle half {f['low']:,.0f} to {f['high']:,.0f})"
                      for n, f in figures.items())
    said = (f"{verdict} was faster in this run: the two middle halves do not overlap" if verdict else
            "the two middle halves overlap, so this run does not say which layout is faster here: the difference is "
            "within what the machine's load moves a step")
    return {"runs": figures, "ratio": ratio, "verdict": verdict,
            "sentence": f"{shown}. {b} ran at {ratio:.2f}x {a}'s median rate; {said}."}


def parity_markdown(rows: list[dict[str, Any]]) -> str:
    """`parity.check` results as a Markdown table, one layout per row (its data-parallel size: the launch's processes
    over TP x PP, since every layout runs in one launch of the smallest world that holds them all)."""
    head = ("| layout | processes | cosine | max abs diff | mean abs diff | argmax agree | loss HF | loss Megatron |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| TP{r['tp']} PP{r['pp']} EP{r['ep']} DP{r['processes'] // (r['tp'] * r['pp'])} | {r['processes']} | "
        f"{r['cosine']:.9f} | {r['max_abs_diff']:.2e} | "
        f"{r['mean_abs_diff']:.2e} | {r['argmax_agreement']:.0%} | {r['hf_loss']:.6f} | {r['megatron_loss']:.6f} |"
        for r in rows)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str] | None = None,
                   formats: Mapping[str, str] | None = None) -> str:
    """Rows of figures as a Markdown table for `IPython.display.Markdown`: `columns` maps a key to its header (default:
    every key of the first row, as it is), `formats` a key to a format spec (e.g. ".2f"); pipes in text are escaped."""
    columns = columns or {k: k for k in rows[0]}
    formats = formats or {}

    def shown(key: str, value: Any) -> str:
        text = "" if value is None else format(value, formats[key]) if key in formats else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    return ("| " + " | ".join(columns.values()) + " |\n|" + "---|" * len(columns) + "\n"
            + "\n".join("| " + " | ".join(shown(k, row.get(k)) for k in columns) + " |" for row in rows))


def save_metrics(output_dir: str | Path, metrics: dict[str, Any]) -> None:
    """Write the notebook's headline figures to output_dir/metrics.json (NaN/inf refused), with the minutes this
    kernel has run (`kernel_minutes`), and print where they went and those minutes: every notebook ends here, so each
    says what it took (a fresh kernel, as in a batch job, ran the notebook alone; a kernel that ran cells before
    counts them too)."""
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise ValueError(f"metrics {bad} are not finite; a notebook must not record NaN/inf as a result")
    minutes = kernel_minutes()
    path = Path(output_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics | {"kernel_minutes": minutes}, indent=2))
    print(f"{len(metrics)} figures written to {path}; this kernel has run {minutes:.1f} minutes")


def kernel_minutes() -> float:
    """Minutes since this process started (the notebook's kernel), by the operating system's record of it."""
    import time

    import psutil

    return (time.time() - psutil.Process().create_time()) / 60


def load_metrics(output_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(output_dir) / METRICS_FILE).read_text())
