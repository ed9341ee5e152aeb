"""Figures the notebooks show and save: one function per figure, each returning the matplotlib Figure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def _finish(fig, path: str | Path | None):
    """Tighten the layout and, when a path is given, save the figure there as PNG."""
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
    values = [max(r["max_abs_diff"], 1e-12) for r in rows]  # exact zero cannot sit on a log axis
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(labels, values, color="tab:blue")
    ax.axhline(bound, color="tab:red", linestyle="--", label=f"bound {bound:g}")
    ax.set_yscale("log")
    ax.set_ylim(1e-10, bound * 10)  # fp32 rounding (~1e-7) sits three decades under the bound
    ax.set_ylabel("max |logit difference|")
    ax.set_title(title)
    ax.legend()
    return _finish(fig, path)


def train_valid_loss(train: Sequence[float], valid: Sequence[Sequence[float]], path: str | Path | None = None,
                     first_step: int = 0, title: str = "Continued pretraining"):
    """Training loss per step with validation loss points ((step, loss) pairs) on the same axes."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(range(first_step + 1, first_step + len(train) + 1), train, linewidth=1.2, label="train")
    if valid:
        steps, losses = zip(*valid)
        ax.plot(steps, losses, "o-", color="tab:red", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
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
               title: str = "Throughput"):
    """One bar per engine or layout (e.g. {"Megatron-Core TP=2": 169.0, "Hugging Face": 221.0})."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(speeds), list(speeds.values()), color=["tab:green", "tab:blue", "tab:orange", "tab:red"][:len(speeds)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _finish(fig, path)


def bits_per_char(rows: Mapping[str, tuple[float, float | None]], reference: float, steps: int,
                  path: str | Path | None = None, title: str = "Held-back Chinese text"):
    """Bars of bits per character per initialisation: at step 0 and (where trained) after `steps` steps,
    with the base model's figure as a dashed line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = list(rows)
    width = 0.38
    for k, (label, pick) in enumerate((("step 0", 0), (f"after {steps} steps", 1))):
        values = [rows[n][pick] for n in names]
        xs = [i + (k - 0.5) * width for i, v in enumerate(values) if v is not None]
        bars = ax.bar(xs, [v for v in values if v is not None], width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(reference, linestyle="--", color="grey", label="base model, old tokenizer")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("bits per character")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _finish(fig, path)
