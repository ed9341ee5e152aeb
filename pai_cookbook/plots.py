"""Figures the notebooks show and save: one function per figure, each returning the matplotlib Figure."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence


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
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
