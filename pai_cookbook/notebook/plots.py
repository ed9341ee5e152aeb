"""Figures the notebooks show and save: one function per figure, each returning the matplotlib Figure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _finish(fig, path: str | Path | None, tight: bool = True):
    """Tighten the layout (unless the figure has its own) and, when a path is given, save it there as PNG. Axes
    labelled "step" get whole-number ticks (a short run's steps would otherwise read 2.5, 7.5)."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:  # a figure that set its own step ticks keeps them
        if ax.get_xlabel() == "step" and not isinstance(ax.xaxis.get_major_locator(), MaxNLocator):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if tight and fig.get_layout_engine() is None:
        fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def loss_curves(curves: Mapping[str, Sequence[float]], path: str | Path | None = None,
                title: str = "Training loss", ylabel: str = "loss"):
    """Overlay per-step curves (e.g. {"TP=1": [...], "TP=2": [...]}); saved as PNG when `path` is given.

    Curves are drawn with decreasing line widths and distinct markers, so curves that coincide
    (the point of a parity plot) stay visible on top of each other.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    styles = [("-", "o"), ("--", "x"), (":", "+"), ("-.", "s")]
    for i, (label, values) in enumerate(curves.items()):
        line, marker = styles[i % len(styles)]
        ax.plot(range(1, len(values) + 1), values, line, marker=marker, markersize=4,
                linewidth=2.5 - 0.6 * (i % 3), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _finish(fig, path)


def parity_bars(rows: Sequence[dict], bound: float, path: str | Path | None = None,
                title: str = "Megatron-Core vs Hugging Face logits"):
    """Max |logit difference| per layout on a log scale, with the bound it must stay under."""
    import matplotlib.pyplot as plt

    labels = [f"TP{r['tp']} PP{r['pp']} EP{r['ep']}" for r in rows]
    floor = 1e-10  # exact zero cannot sit on a log axis: it is drawn at the axis' floor, marked and labelled
    values = [max(r["max_abs_diff"], floor) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(labels, values, color="tab:blue")
    for i, r in enumerate(rows):
        exact = r["max_abs_diff"] == 0
        ax.plot(i, values[i], "v" if exact else "o", color="black", markersize=6)
        ax.annotate("0 (exact)" if exact else f"{r['max_abs_diff']:.1e}", (i, values[i]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.axhline(bound, color="tab:red", linestyle="--", label=f"bound {bound:g}")
    ax.set_yscale("log")
    ax.set_ylim(1e-10, bound * 10)  # fp32 rounding (~1e-7) sits three decades under the bound
    ax.set_ylabel("max |logit difference|")
    ax.set_title(title)
    ax.legend()
    return _finish(fig, path)


def train_valid_loss(train: Sequence[float], valid: Sequence[Sequence[float]], path: str | Path | None = None,
                     first_step: int = 0, title: str = "Continued pretraining",
                     grad_norms: Sequence[float | None] | None = None):
    """Training loss per step with validation loss points ((step, loss) pairs) on the same axes; with `grad_norms`,
    the gradient norm per step in a panel below (where a loss spike's cause shows first)."""
    import matplotlib.pyplot as plt

    panels = 2 if grad_norms else 1
    fig, axes = plt.subplots(panels, 1, figsize=(6.4, 3.6 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    steps = range(first_step + 1, first_step + len(train) + 1)
    ax.plot(steps, train, linewidth=1.2, label="train")
    if valid:
        valid_steps, losses = zip(*valid)
        ax.plot(valid_steps, losses, "o-", color="tab:red", label="validation")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if grad_norms:
        norm = axes[1][0]
        norm.plot(steps, [float("nan") if g is None else g for g in grad_norms], linewidth=1.0, color="tab:green")
        norm.set_ylabel("gradient norm (before clipping)")
        norm.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    return _finish(fig, path)


def expert_load(runs: Mapping[str, Sequence[dict]], layer: int = 0, path: str | Path | None = None,
                title: str = "Share of routed tokens per expert"):
    """Heat maps of each expert's token share per step (one panel per run), in units of the fair share.

    Args:
        runs: label -> `train.run(...)["router"]` (per-step router figures of an MoE run).
        layer: index among the MoE layers.
    White is the fair share (1.0); red an overloaded expert, blue a starved one (0 = no tokens).
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), squeeze=False)
    for ax, (label, steps) in zip(axes[0], runs.items()):
        shares = np.array([step["expert_load"][layer] for step in steps]).T  # experts x steps
        fair_units = shares * shares.shape[0]
        image = ax.imshow(fair_units, aspect="auto", cmap="RdBu_r", interpolation="nearest",
                          norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(2.0, float(fair_units.max()))),
                          extent=(0.5, shares.shape[1] + 0.5, shares.shape[0] - 0.5, -0.5))
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        ax.set_title(label)
        fig.colorbar(image, ax=ax, label="share / fair share")
    fig.suptitle(f"{title} (MoE layer {layer})")
    return _finish(fig, path)


def throughput(speeds: Mapping[str, float], path: str | Path | None = None, ylabel: str = "generated tokens/s",
               title: str = "Throughput", spread: Mapping[str, Sequence[float]] | None = None):
    """One bar per setting, engine or layout (e.g. {"greedy, batch 1": 31.0, "greedy, batch 4": 96.0}); with `spread`
    (name -> every run's figure), a line over each bar from the lowest run to the highest."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.9 * len(speeds) + 1.5, 3.4), layout="constrained")
    names = list(speeds)
    bars = ax.bar(names, [speeds[n] for n in names], color=["tab:green", "tab:blue", "tab:orange", "tab:red"][:len(names)])
    if spread:
        for x, name in enumerate(names):
            ax.vlines(x, min(spread[name]), max(spread[name]), color="black", linewidth=1.5)
    ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    return _finish(fig, path)


def bits_per_char(rows: Mapping[str, tuple[float, float | None]], reference: float, steps: int,
                  path: str | Path | None = None, title: str = "Held-back Chinese text", floor: float | None = None):
    """Bars of bits per character per initialisation: at step 0 and (where trained) after `steps` steps,
    with the base model's figure as a dashed line and, given `floor`, a model that knows nothing as a dotted one."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = list(rows)
    width = 0.38
    for k, (label, pick) in enumerate((("step 0", 0), (f"after {steps} steps", 1))):
        values = [rows[n][pick] for n in names]
        xs = [i + (k - 0.5) * width for i, v in enumerate(values) if v is not None]
        bars = ax.bar(xs, [v for v in values if v is not None], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(reference, linestyle="--", color="grey", label="base model, old tokenizer")
    if floor is not None:
        ax.axhline(floor, linestyle=":", color="black", label="knows nothing, extended tokenizer")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("bits per character")
    ax.set_title(title)
    ax.set_ylim(0, max([reference, floor or 0] + [v for pair in rows.values() for v in pair if v is not None]) * 1.1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)  # below: the lines run at the top
    return _finish(fig, path)


def _smooth(values: Sequence[float], window: int):
    """Trailing moving average (the first points average what exists so far)."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def fp8_convergence(band: Mapping, runs: Mapping[str, Sequence[float]], path: str | Path | None = None,
                    window: int = 20, relative_bound: float = 0.005, baseline: str = "BF16",
                    title: str = "FP8 against the BF16 seed band"):
    """Top: loss (moving average over `window` steps) of each run over the baseline seeds' min-max band.
    Bottom: each run's gap to the baseline mean, over the seeds' own gaps and +-`relative_bound`; a run that
    leaves the panel is marked at its edge with its final gap.

    band: `fp8.seed_band(...)`; runs: name -> per-step losses (e.g. a setting's mean over seeds).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    seeds = np.stack([_smooth(c, window) for c in band["curves"].T])  # [seeds, steps]
    mean = seeds.mean(axis=0)
    steps = np.arange(1, seeds.shape[1] + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.2, 6.4), sharex=True, height_ratios=[3, 2])
    top.fill_between(steps, seeds.min(axis=0), seeds.max(axis=0), color="0.8",
                     label=f"{baseline}, {len(seeds)} seeds")
    bottom.fill_between(steps, (seeds - mean).min(axis=0), (seeds - mean).max(axis=0), color="0.8",
                        label=f"{baseline} seeds")
    # the gap panel's scale is the band's: a run far outside it would flatten every other line to zero
    limit = 2.5 * max(float(np.abs(seeds - mean).max()), relative_bound * float(mean.max()))
    for i, (name, losses) in enumerate(runs.items()):
        smooth = _smooth(losses, window)
        style = dict(color=f"C{i}", linewidth=1.4, linestyle=("-", "--", "-.", ":")[i % 4])
        top.plot(steps[:len(smooth)], smooth, label=name, **style)
        gap = smooth - mean[:len(smooth)]
        bottom.plot(steps[:len(smooth)], np.clip(gap, -limit, limit), label=name, **style)
        if abs(gap[-1]) > limit:
            end = (steps[len(gap) - 1], np.sign(gap[-1]) * limit)
            bottom.annotate(f"{name}: {gap[-1]:+.2f} at the end, off the scale", end,
                            xytext=(-8, -12 if gap[-1] > 0 else 6), textcoords="offset points", ha="right",
                            fontsize=8, color=f"C{i}")
    for sign in (1, -1):
        bottom.plot(steps, sign * relative_bound * mean, "k:", linewidth=1,
                    label=f"+-{relative_bound:.1%} of {baseline}" if sign > 0 else None)
    bottom.set_ylim(-limit * 1.05, limit * 1.05)
    top.set_ylabel(f"loss ({window}-step mean)")
    top.set_title(title)
    bottom.set_ylabel(f"gap to {baseline} mean")
    bottom.set_xlabel("step")
    top.legend(fontsize=8, loc="upper right")
    bottom.legend(fontsize=7, loc="lower left", ncols=2)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return _finish(fig, path)


def fp8_scaling(histories: Mapping[str, Sequence[Mapping]], linear: str, path: str | Path | None = None,
                title: str | None = None):
    """amax (top) and scale (bottom) of one linear's three operands (input, weight, output gradient) over
    the steps, one line per run; log scale. histories: name -> a result's "fp8" list."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    roles = ("input", "weight", "grad")
    fig, axes = plt.subplots(2, 3, figsize=(10.4, 5.6), sharex=True, layout="constrained")
    for i, (name, history) in enumerate(histories.items()):
        for j, role in enumerate(roles):
            for row, figure in enumerate(("amax", "scale")):
                values = [step[linear][role][figure] for step in history]
                axes[row, j].plot(range(1, len(values) + 1), values, color=f"C{i}", linewidth=1.2, label=name)
    for j, role in enumerate(roles):
        axes[0, j].set_title("output gradient" if role == "grad" else role)
        axes[1, j].set_xlabel("step")
    axes[0, 0].set_ylabel("amax")
    axes[1, 0].set_ylabel("scale")
    for ax in axes.flat:
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))  # a few steps' labels, none touching
        ax.tick_params(axis="both", labelsize=8)
        ax.grid(alpha=0.3)
    axes[0, 2].legend(fontsize=8)
    fig.suptitle(title or f"Scaling of {linear}")
    return _finish(fig, path)


def fp8_heatmap(histories: Mapping[str, Sequence[Mapping]], role: str = "grad", figure: str = "underflow",
                path: str | Path | None = None):
    """Fraction of one operand's values that under- or overflowed, per linear (rows) and step (columns),
    one panel per run, on one colour scale from 0 to 1."""
    import matplotlib.pyplot as plt

    from pai_cookbook import fp8

    fig, axes = plt.subplots(len(histories), 1, figsize=(8.0, 1.2 + 1.6 * len(histories)), squeeze=False,
                             layout="constrained")  # room for the shared colour bar
    image = None
    for ax, (name, history) in zip(axes[:, 0], histories.items()):
        names, values = fp8.statistics(history, role, figure)
        image = ax.imshow(values.T, aspect="auto", cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest",
                          extent=(0.5, len(values) + 0.5, len(names) - 0.5, -0.5))
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_title(name, fontsize=9)
    axes[-1, 0].set_xlabel("step")
    operand = "output gradient" if role == "grad" else role
    fig.colorbar(image, ax=axes[:, 0].tolist(), label=f"{operand} {figure} fraction")
    fig.suptitle(f"{operand.capitalize()} values that {'rounded to zero' if figure == 'underflow' else 'saturated'}")
    return _finish(fig, path, tight=False)


def rl_curves(histories: Mapping[str, Mapping[str, Sequence[float]]],
              figures: Sequence[tuple[str, str]] = (("reward", "mean reward of the batch"),
                                                    ("kl", "KL to the reference (per token)"),
                                                    ("entropy", "entropy (nats per token)")),
              path: str | Path | None = None, window: int = 4):
    """One panel per logged figure of RL runs (`rlhf.history`), each run a line: its raw per-step values faint,
    a `window`-step moving average over them."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(4.2 * len(figures), 3.4))
    for ax, (key, label) in zip(axes, figures):
        ax.set_ylabel(label.split(" (")[0])
        for i, (run, history) in enumerate(histories.items()):
            values = [v for v in history[key] if v is not None]
            steps = range(1, len(values) + 1)
            color = f"C{i}"
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, _smooth(values, window), color=color, linewidth=2, label=run)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _finish(fig, path)


def reward_margins(chosen: Sequence[float], rejected: Sequence[float], path: str | Path | None = None,
                   title: str = "Reward model on held-out pairs"):
    """Histogram of r(chosen) - r(rejected) per held-out pair: right of 0 is a pair ranked right."""
    import matplotlib.pyplot as plt

    differences = [c - r for c, r in zip(chosen, rejected)]
    right = sum(d > 0 for d in differences) / len(differences)
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.hist(differences, bins=40, color="tab:blue", alpha=0.8)
    ax.axvline(0, color="tab:red", linestyle="--")
    ax.set_xlabel("r(chosen) - r(rejected)")
    ax.set_ylabel("pairs")
    ax.set_title(f"{title}: {right:.1%} ranked right")
    return _finish(fig, path)


def proxy_and_true_reward(evals: Mapping[str, Mapping[str, Sequence[float]]],
                          histories: Mapping[str, Mapping[str, Sequence[float]]], kl_target: float | None = None,
                          path: str | Path | None = None, window: int = 4):
    """Reward over-optimisation at a glance, one line per RL run: the held-out proxy reward (what the policy is
    trained on, `rlhf.evals`), the held-out true reward beside it, and the KL per completion of each step's
    samples (`rlhf.history`, `window`-step moving average over the faint raw values), with the target the
    adaptive controller steers to."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12.6, 3.4))
    for i, run in enumerate(evals):
        color = f"C{i}"
        axes[0].plot(evals[run]["step"], evals[run]["reward"], "o-", color=color, linewidth=2, label=run)
        axes[1].plot(evals[run]["step"], evals[run]["true_reward"], "o-", color=color, linewidth=2, label=run)
        values = histories[run]["kl_sequence"]
        steps = range(1, len(values) + 1)
        axes[2].plot(steps, values, color=color, alpha=0.25, linewidth=1)
        axes[2].plot(steps, _smooth(values, window), color=color, linewidth=2, label=run)
    if kl_target is not None:
        axes[2].axhline(kl_target, color="black", linestyle="--", linewidth=1, label="KL target")
    titles = ("held-out score of the reward model (proxy)", "held-out true reward (never trained on)",
              "KL to the reference (per completion)")
    for ax, title, ylabel in zip(axes, titles, ("reward model's score", "true reward (0 to 1)", "KL (nats)")):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("symlog", linthresh=1.0)
    axes[2].set_ylim(bottom=0)  # k1 estimates can dip below 0 by noise; the KL itself cannot
    axes[2].legend(fontsize=8)
    return _finish(fig, path)


def evaluation_bars(rows: Sequence[Mapping[str, Any]], metrics: Mapping[str, str], path: str | Path | None = None,
                    title: str = "Evaluation", chance: Mapping[str, float] | None = None):
    """One panel per metric (`metrics`: row key -> axis label), one bar per row's "model"; `chance` (row key ->
    value) draws a dashed line where guessing would score."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics) + 0.5, 3.4), layout="constrained")
    axes = [axes] if len(metrics) == 1 else list(axes)
    names = [str(row["model"]) for row in rows]
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green"]
    for ax, (key, label) in zip(axes, metrics.items()):
        values = [row[key] for row in rows]
        bars = ax.bar(names, values, color=[colors[i % len(colors)] for i in range(len(rows))])
        ax.set_ylim(0, max(*values, (chance or {}).get(key, 0.0)) * 1.2 or 1.0)  # all zero: an axis to 1
        ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
        if chance and key in chance:
            ax.axhline(chance[key], color="black", linestyle="--", linewidth=1, label="chance")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle(title, fontsize=10)
    return _finish(fig, path, tight=False)


def serving_speed(rows: Sequence[Mapping[str, Any]], path: str | Path | None = None, title: str = "Serving speed"):
    """Two panels against requests in flight, one line per model: generated tokens/s, and the mean time to first token."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green"]  # evaluation_bars' order
    for i, name in enumerate(dict.fromkeys(str(r["model"]) for r in rows)):
        mine = [r for r in rows if str(r["model"]) == name]
        for ax, key in zip(axes, ("tokens/s", "time to first token (s)")):
            ax.plot([r["requests at once"] for r in mine], [r[key] for r in mine], "o-", label=name, color=colors[i % 4])
    ticks = sorted({r["requests at once"] for r in rows})
    for ax, label in zip(axes, ("generated tokens/s", "time to first token (s)")):
        ax.set_xscale("log", base=2)
        ax.set(xticks=ticks, xticklabels=[str(c) for c in ticks], xlabel="requests at once", ylabel=label, ylim=(0, None))
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _finish(fig, path, tight=False)
