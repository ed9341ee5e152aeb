"""Explain a plan to a newcomer (notebook 09): the layouts that fit as a short Markdown table, their memory per
component as stacked bars, the step-time terms side by side, sentences saying why the fastest wins, the chosen layout
as notebook 03's parameters, and a CPU run's measured memory beside the prediction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pai_cookbook.core.configs.config import ModelConfig, ParallelConfig, RunConfig
from pai_cookbook.plan import memory, search, states
from pai_cookbook.plan.hardware import GIB
from pai_cookbook.plan.layouts import Layout, Workload
from pai_cookbook.plan.search import Option
from pai_cookbook.plan.speed import TERMS

MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "transient", "overhead")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:gray")
PLAIN = Layout()
"""The plainest layout: data parallel only (TP1 PP1), micro-batch 1, no recompute, Adam's state on every GPU."""


def parameters(model: ModelConfig) -> int:
    """The model's parameters (what one GPU holds at TP1 PP1)."""
    return states.states(model, PLAIN, Workload(seq_length=1, global_batch_size=1), 1, 0).params


def plainest(options: Sequence[Option]) -> Option | None:
    """The option of `PLAIN`, if the plan has it (a global batch DP does not divide has none)."""
    return next((o for o in options if o.layout == PLAIN), None)


def layouts_markdown(options: Sequence[Option], memory_gib: float, tokens: float | None = None) -> str:
    """One row per option: layout, memory per GPU against the GPU's, tokens/s of the cluster, and days for `tokens`."""
    days = f" days for {tokens:.0e} tokens |" if tokens else ""
    head = f"| | layout | GiB per GPU (of {memory_gib:g}) | tokens/s |{days}\n|---|---|---|---|{'---|' * bool(tokens)}\n"
    return head + "\n".join(
        f"| {i} | {o.layout.describe()}{' (CP: needs TE, Megatron-LM/NeMo)' if o.layout.cp > 1 else ''} | "
        f"{o.memory.total / GIB:.1f}{'' if o.fits else ' (does not fit)'} | "
        f"{o.time.tokens_per_s:,.0f} |" + (f" {o.time.days(tokens):.1f} |" if tokens else "")
        for i, o in enumerate(options, 1))


def time_markdown(options: Mapping[str, Option]) -> str:
    """Each step-time term in ms (its share of the step) for each named option, one column each."""
    head = "| term | " + " | ".join(f"{name}: {o.layout.describe()}" for name, o in options.items()) + " |\n"
    rows = []
    for term in TERMS + ("total",):
        cells = [o.time.terms()[term] for o in options.values()]
        if term != "total" and not any(cells):
            continue  # a term no option has (cp without CP, ep without experts)
        rows.append(f"| {term} | " + " | ".join(f"{c * 1e3:,.0f} ms ({c / o.time.total:.1%})"
                                                 for c, o in zip(cells, options.values())) + " |")
    return head + "|---|" + "---|" * len(options) + "\n" + "\n".join(rows)


def memory_bars(options: Sequence[Option], memory_gib: float, path: str | Path | None = None,
                title: str = "Predicted peak memory per GPU"):
    """Stacked horizontal bars of each option's memory terms (GiB per GPU, most loaded pipeline stage), fastest at
    the top, with the GPU's memory as a vertical line; saved as PNG when `path` is given."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.4, 0.45 * len(options) + 1.6))
    labels = [o.layout.describe() + ("" if o.fits else " (does not fit)") for o in options]
    left = [0.0] * len(options)
    for term, color in zip(MEMORY_TERMS, COLORS):
        values = [o.memory.terms()[term] / GIB for o in options]
        ax.barh(labels, values, left=left, color=color, label=term)
        left = [a + b for a, b in zip(left, values)]
    for y, total in enumerate(left):
        ax.text(total + 1, y, f"{total:.1f}", va="center", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    ax.axvline(memory_gib, color="black", linestyle="--", label=f"GPU memory {memory_gib:g} GiB")
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU")
    ax.set_xlim(0, max(left + [memory_gib]) * 1.1)
    fig.suptitle(title)  # across the figure: the layouts' names take its left half
    fig.legend(*ax.get_legend_handles_labels(), fontsize=8, ncol=4, loc="lower center")
    fig.tight_layout(rect=(0, 1.0 / (len(options) + 4), 1, 1))  # room for the legend below
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def why(options: Sequence[Option], memory_gib: float) -> list[str]:
    """Sentences, computed from the ranked `options`, saying why the first one wins: the term that dominates its step,
    what the runner-up trades, whether the plainest layout fits, what full recompute costs, which layouts are tied
    with the fastest (`search.TIED_WITHIN`), and which of them without CP `search.choose` takes: the most memory free."""
    fitting = [o for o in options if o.fits]
    if not options:
        return ["No layout is valid for this workload on this cluster, so there is nothing to rank (`search.plan` "
                "says what every layout needs)."]
    if not fitting:
        least = min(options, key=lambda o: o.memory.total)
        return [f"No layout fits: the smallest, {least.layout.describe()}, needs {least.memory.total / GIB:.1f} GiB "
                f"per GPU of {memory_gib:g}. Add GPUs, take a GPU with more memory, or shorten the sequence."]
    best = fitting[0]
    terms = {k: v for k, v in best.time.terms().items() if k != "total"}
    top = max(terms, key=terms.get)
    extra = {k: v for k, v in terms.items() if k != top and v}
    lines = [f"{best.layout.describe()} is the fastest layout that fits: {top} is {terms[top] / best.time.total:.1%} "
             f"of its {best.time.total:.2f} s step; the rest ({', '.join(extra) or 'nothing'}) adds "
             f"{sum(extra.values()) * 1e3:,.0f} ms."]
    if len(fitting) > 1:
        second = fitting[1]
        dt = {k: second.time.terms()[k] - best.time.terms()[k] for k in TERMS}
        worse = max(dt, key=dt.get)
        dm = {k: (second.memory.terms()[k] - best.memory.terms()[k]) / GIB for k in MEMORY_TERMS}
        moved = sorted(dm, key=lambda k: -abs(dm[k]))[:2]
        pace = (f"takes {second.time.total / best.time.total - 1:.2%} longer per step, mostly in {worse} "
                f"({dt[worse] * 1e3:+,.0f} ms)" if dt[worse] > 0 else "is as fast")
        lines.append(f"The runner-up, {second.layout.describe()}, {pace}, and needs {abs(sum(dm.values())):.1f} GiB "
                     f"{'less' if sum(dm.values()) < 0 else 'more'} per GPU ("
                     + ", ".join(f"{k} {dm[k]:+.1f} GiB" for k in moved) + ").")
    plain = plainest(options)
    if plain is not None:
        lines.append(f"The plainest layout, {plain.layout.describe()} (data parallel only), needs "
                     f"{plain.memory.total / GIB:.1f} GiB per GPU: it {'fits' if plain.fits else 'does not fit'} in "
                     f"{memory_gib:g}.")
    full = next((o for o in fitting if o.layout.recompute == "full"), None)
    if full is not None:
        slower = 1 - full.time.tokens_per_s / best.time.tokens_per_s
        lines.append(f"The fastest layout with full recompute, {full.layout.describe()}, needs "
                     f"{full.memory.total / GIB:.1f} GiB per GPU and is {slower:.1%} slower: "
                     f"it frees the activations by running every layer's forward twice.")
    tied = search.tied_with_fastest(list(options))
    chosen = search.choose(list(options))
    if len(tied) > 1:
        lines.append(f"{len(tied)} layouts are within {search.TIED_WITHIN:.0%} of the fastest one's speed (the slowest of "
                     f"them {1 - tied[-1].time.tokens_per_s / best.time.tokens_per_s:.1%} behind), a difference the step "
                     f"time cannot rank: a tie.")
    if chosen is not None:
        lines.append(f"Of the tied layouts without CP, {chosen.layout.describe()} leaves the most memory free: "
                     f"{memory_gib - chosen.memory.total / GIB:.1f} GiB of {memory_gib:g} "
                     f"({chosen.memory.total / GIB:.1f} GiB used), at "
                     f"{1 - chosen.time.tokens_per_s / best.time.tokens_per_s:.1%} below the fastest's speed; "
                     f"section 3 takes it.")
    return lines


def pretraining_parameters(config: RunConfig, gpus_per_node: int) -> tuple[dict, dict]:
    """Notebook 03's parameters for `config` on nodes of `gpus_per_node` GPUs, and the `ParallelConfig` fields that
    notebook takes no parameter for (to set in its configuration cell) where they differ from the default."""
    p, default = config.parallel, ParallelConfig()
    params = {"TP_SIZE": p.tensor_model_parallel_size, "PP_SIZE": p.pipeline_model_parallel_size,
              "SEQUENCE_PARALLEL": p.sequence_parallel, "NPROC": gpus_per_node,
              "SEQ_LENGTH": config.data.seq_length, "MICRO_BATCH_SIZE": config.data.micro_batch_size,
              "GLOBAL_BATCH_SIZE": config.data.global_batch_size, "PRECISION": config.precision.dtype,
              "RECOMPUTE": config.memory.recompute_granularity,
              "DISTRIBUTED_OPTIMIZER": config.optimizer.use_distributed_optimizer}
    others = {name: getattr(p, name) for name in ("virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                                                  "expert_tensor_parallel_size")
              if getattr(p, name) != getattr(default, name)}
    return params, others


def comparison_markdown(runs: Mapping[str, list[dict]]) -> str:
    """`plan.memory.compare` rows of each named run as one table row per rank: predicted / measured bytes and the
    relative error of each term."""
    terms = memory.MEASURED
    head = "| run | rank | " + " | ".join(terms) + " |\n|---|---|" + "---|" * len(terms) + "\n"
    lines = []
    for name, rows in runs.items():
        for rank in sorted({r["rank"] for r in rows}):
            cells = {r["term"]: r for r in rows if r["rank"] == rank}
            lines.append(f"| {name} | {rank} | " + " | ".join(
                f"{cells[t]['predicted']:,} / {cells[t]['measured']:,} ({cells[t]['relative_error']:.2%})"
                for t in terms) + " |")
    return head + "\n".join(lines)
