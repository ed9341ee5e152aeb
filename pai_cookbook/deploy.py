"""What a quantized model costs, measured on the server that runs it (notebook 13):

    with serve.Server(folder) as server:
        measured[name] = deploy.measure(server, texts=held_out, cloze=items, mmlu=(tasks, "mmlu_sample"),
                                        prompts=prompts)
    rows = deploy.differences(measured, reference="bf16")      # each measure's change, in its standard errors
    deploy.serving_memory(shapes.model_shape("Llama-3-8B"), "int4", requests=16, context=4096)

Notebook 11's three measures (bits per byte on held-out text, cloze accuracy, MMLU through the harness) on the
server (`evaluate` and `harness.ServedLM` take a running `serve.Server`), and `serve.throughput` beside them. The
differences are paired: every text, item and question is scored by both models, so a change is judged against the
spread of the per-item changes, not of the scores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pai_cookbook import evaluate, harness, quantize, serve
from pai_cookbook.core.configs.generation import kv_cache_bytes

__all__ = ["differences", "measure", "paired", "serving_memory"]

LN2 = math.log(2)


def measure(server: serve.Server, *, texts: Sequence[str], cloze: Sequence[Mapping[str, str]],
            mmlu: tuple[str | Path, str], prompts: Sequence[str], concurrency: Sequence[int] = (1, 4, 16),
            max_tokens: int = 64) -> dict[str, Any]:
    """Perplexity of `texts`, the cloze items ({"context", "word"}), the harness task `mmlu` = (include folder, task
    name), then `serve.throughput` on chat `prompts`; per-item figures kept for `differences`."""
    ppl = evaluate.perplexity(server, texts)
    scored = evaluate.loglikelihood(server, [(item["context"], " " + item["word"]) for item in cloze])
    folder, task = mmlu
    result = harness.run(harness.ServedLM(server), [task], include_path=folder)
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return {"bits_per_byte": ppl["bits_per_byte"], "token_perplexity": ppl["token_perplexity"],
            "text_bits": [-lp / LN2 for lp in ppl["per_text"]], "bytes": ppl["bytes"],
            "cloze_correct": [float(r["greedy"]) for r in scored["results"]],
            "mmlu_correct": [float(s["acc"]) for s in samples],
            "cloze_accuracy": sum(r["greedy"] for r in scored["results"]) / len(cloze),
            "mmlu_accuracy": result["results"][task]["acc,none"],
            "speed": serve.throughput(server, prompts, concurrency=concurrency, max_tokens=max_tokens),
            "startup_s": server.startup_s}


def paired(reference: Sequence[float], other: Sequence[float]) -> tuple[float, float]:
    """Mean of other - reference over paired items, and its standard error (the per-item differences' sample
    standard deviation over the square root of their number)."""
    diffs = [b - a for a, b in zip(reference, other, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    return mean, spread / math.sqrt(n)


def differences(measured: Mapping[str, Mapping[str, Any]], reference: str) -> list[dict[str, Any]]:
    """One row per model: its three measures and each one's change from `reference` with the change's standard error
    and their ratio ("z"; None where every item scored the same both ways). Bits per byte: the change in total bits
    over the total bytes, its error from the per-text changes."""
    ref = measured[reference]
    rows = []
    for name, m in measured.items():
        row: dict[str, Any] = {"model": name, "bits per byte": m["bits_per_byte"], "cloze accuracy": m["cloze_accuracy"],
                               "MMLU accuracy": m["mmlu_accuracy"]}
        mean, se = paired(ref["text_bits"], m["text_bits"])
        n = len(m["text_bits"])
        row["bpb change"], row["bpb s.e."] = mean * n / m["bytes"], se * n / m["bytes"]
        for key, label in (("cloze_correct", "cloze"), ("mmlu_correct", "MMLU")):
            row[f"{label} change"], row[f"{label} s.e."] = paired(ref[key], m[key])
        for label in ("bpb", "cloze", "MMLU"):
            change, se = row[f"{label} change"], row[f"{label} s.e."]
            row[f"{label} z"] = change / se if se > 0 else None
        rows.append(row)
    return rows


def serving_memory(model, scheme: str | None, *, requests: int, context: int, tp: int = 1) -> dict[str, float]:
    """GiB a server holds on each of `tp` GPUs for `model` (a planner shape, `plan.shapes.model_shape`) under
    `scheme` (None: bf16): the decoder's linear weights at the scheme's bits (with one bf16 scale per output channel,
    or per group of 128 inputs for INT4), embeddings, output layer and norms in bf16, and a bf16 KV cache for
    `requests` sequences of `context` tokens (`kv_cache_bytes`)."""
    from pai_cookbook.plan import explain

    total = explain.parameters(model)
    embeddings = model.padded_vocab_size(1) * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    norms = (2 * model.num_layers + 1) * model.hidden_size
    linear = total - embeddings - norms
    if scheme is None:
        weight_bytes = 2.0 * linear
    else:
        bits = quantize.SCHEMES[scheme]["weights_bits"]
        scales = 2.0 / 128 if bits == 4 else 2.0 / model.hidden_size
        weight_bytes = linear * (bits / 8 + scales)
    weights = (weight_bytes + 2.0 * (embeddings + norms)) / tp
    kv = kv_cache_bytes(model, requests, context, 2, tp=tp)
    gib = 2.0 ** 30
    return {"weights_gib": weights / gib, "kv_cache_gib": kv / gib, "total_gib": (weights + kv) / gib}
