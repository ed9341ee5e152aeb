"""Figures the notebooks show and save: one function per figure, each returning the matplotlib Figure."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


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
