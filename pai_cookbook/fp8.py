"""Is FP8 safe for this run? Convergence verdicts against a BF16 seed band, and the FP8 statistics.

    results = train.sweep({"bf16 seed 1": ..., "bf16 seed 2": ..., "delayed": ...})
    band = fp8.seed_band({n: r["losses"] for n, r in results.items() if n.startswith("bf16")})
    fp8.verdict([results["delayed"]["losses"]], band)   # mean, gap, within 2x the seed spread and 0.5%?
    fp8.statistics(results["delayed"]["fp8"], "grad", "underflow")   # steps x linears, for a heat map

The precision itself is configured by `core.configs.config.FP8Config` (recipe, format, amax history, margin,
backend) and, where FP8 tensor cores are absent, emulated by `core.modeling.fp8` (quantize/dequantize with the
recipe's scales, labelled "emulated" in every result). A seed band is the honest yardstick: two BF16 runs
that differ only in their seed already differ, so an FP8 run is judged against that spread, not against
one curve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

TAIL_STEPS = 100
"""Steps at the end of a run over which its loss is averaged (single steps are noisy: 8 samples each)."""
BAND_FACTOR = 2.0
"""A run is within the band when it is within this many seed spreads of the BF16 mean."""
MAX_RELATIVE_GAP = 0.005
"""...and within this fraction (0.5%) of the BF16 mean."""


def tail_mean(losses: Sequence[float], steps: int = TAIL_STEPS) -> float:
    """Mean loss over the last `steps` steps; raises when the run is shorter."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1 (the tail's length).")
    if len(losses) < steps:
        raise ValueError(f"a run of {len(losses)} steps has no {steps}-step tail; train longer or pass steps=")
    return float(np.mean(losses[-steps:]))


def seed_band(runs: Mapping[Any, Sequence[float]], steps: int = TAIL_STEPS) -> dict[str, Any]:
    """The BF16 yardstick from runs that differ only in their seed (keyed by seed or name).

    Returns:
        {"tails": name -> tail mean, "mean", "spread" (max - min of the tails), "curves": steps x seeds}
    """
    if len(runs) < 2:
        raise ValueError(f"a seed band needs at least 2 seeds, got {len(runs)}: {list(runs)}")
    tails = {name: tail_mean(losses, steps) for name, losses in runs.items()}
    values = list(tails.values())
    return {"tails": tails, "mean": float(np.mean(values)), "spread": float(max(values) - min(values)),
            "steps": steps, "curves": np.array([list(losses) for losses in runs.values()]).T}


def verdict(curves: Sequence[Sequence[float]], band: Mapping[str, Any]) -> dict[str, Any]:
    """One setting against the band: the mean over its seeds' tail means, the gap to the band's mean, and
    both criteria. Train the setting with the band's seeds: the seeds then cancel in the gap.

    curves: one per-step loss list per seed.
    Returns:
        {"tail_mean", "gap", "relative_gap", "in_band" (|gap| <= 2 x spread), "within_relative"
        (|gap| <= 0.5% of the band's mean), "ok" (both)}
    """
    tail = float(np.mean([tail_mean(c, band["steps"]) for c in curves]))
    gap = tail - band["mean"]
    in_band = abs(gap) <= BAND_FACTOR * band["spread"]
    within = abs(gap) <= MAX_RELATIVE_GAP * band["mean"]
    return {"tail_mean": tail, "gap": gap, "relative_gap": gap / band["mean"], "in_band": bool(in_band),
            "within_relative": bool(within), "ok": bool(in_band and within)}


def mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """Step-by-step mean over seeds."""
    lengths = sorted({len(c) for c in curves})
    if len(lengths) != 1:
        raise ValueError(f"the curves have different lengths {lengths}: average runs of the same number of steps "
                         f"(train every seed for as many steps).")
    return np.mean(np.array([list(c) for c in curves]), axis=0).tolist()


def formats() -> list[dict[str, Any]]:
    """What each FP8 format can hold: largest and smallest values, and the binades between them."""
    from pai_cookbook.core.modeling import fp8 as numerics

    rows = []
    for name in numerics.FORMATS:
        grid = numerics.representable(name)
        positive = grid[grid > 0]
        rows.append({"format": name, "largest": float(grid[-1]), "smallest": float(positive[0]),
                     "binades": float(np.log2(float(grid[-1]) / float(positive[0]))),
                     "values": len(grid)})
    return rows


def scaling_demo(values: Any, formats: Sequence[str] = ("e4m3", "e5m2")) -> list[dict[str, Any]]:
    """`values` (a tensor) cast to each format unscaled and with a tensorwise scale: the fractions that
    underflowed to zero or saturated, and the mean relative error of the rest."""
    import torch

    from pai_cookbook.core.modeling import fp8 as numerics

    rows = []
    for fmt in formats:
        for label, scale in (("none", torch.ones(())), ("fp8_max / amax", numerics.current_scale(
                values.abs().max(), fmt))):
            out, counts = numerics.quantize(values, scale, fmt)
            kept = out != 0
            error = ((out[kept] - values[kept]).abs() / values[kept].abs()).mean() if kept.any() else float("nan")
            rows.append({"format": fmt, "scale": label, "underflow": counts.underflow / counts.numel,
                         "overflow": counts.overflow / counts.numel, "relative_error": float(error)})
    return rows


def statistics(history: Sequence[Mapping[str, Any]], role: str, figure: str) -> tuple[list[str], np.ndarray]:
    """One FP8 figure of one operand role over a run: (linear names, array [steps, linears]).

    history: a result's "fp8" list (per step: linear -> role -> figures), from an emulated-FP8 run.
    role: "input", "weight" or "grad"; figure: "amax", "scale", "overflow" or "underflow" (fractions).
    """
    if not history:
        raise ValueError("no FP8 statistics: the run had no FP8 (precision.fp8 is None) or ran on the te backend, "
                         "whose statistics stay inside Transformer Engine.")
    names = list(history[0])
    return names, np.array([[step[name][role][figure] for name in names] for step in history])


def worst(history: Sequence[Mapping[str, Any]], skip: int = 1) -> dict[str, tuple[str, float]]:
    """Per operand role and over/underflow: the linear with the largest mean fraction after `skip` steps
    (step 0 of the delayed recipe runs at scale 1, before any amax is known)."""
    out = {}
    for role in ("input", "weight", "grad"):
        for figure in ("overflow", "underflow"):
            names, values = statistics(history, role, figure)
            mean = values[skip:].mean(axis=0)
            out[f"{role} {figure}"] = (names[int(mean.argmax())], float(mean.max()))
    return out
