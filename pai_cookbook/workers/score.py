"""The scoring worker: bits per character of checkpoints on texts, and an extended model against its base.

Its job is a `core.launching.jobs.ScoreJob`. Per-token losses of models with different tokenizers are
not comparable (a token is a different amount of text); bits per character are: each text is scored
as [separator] + its tokens under the checkpoint's own tokenizer, so every character is predicted from
the same context, and the total is divided by the characters. For a pair (base, extended), the two
models' logits on the same token ids are compared: old entries (bitwise), the full-softmax KL, and
the probability mass on the new and on the padding rows.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import ParallelConfig, PrecisionConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import ScoreJob
from pai_cookbook.core.text import tokenizer
from pai_cookbook.workers.models import build_model


@functools.lru_cache(maxsize=16)
def _tokenizer(folder: Path):
    return tokenizer.load(folder)


def _documents(folder: Path, texts: list[str]) -> list[list[int]]:
    """Each text as [separator] + its tokens: every token of the text is predicted, from the same context."""
    hf = _tokenizer(folder)
    separator = tokenizer.eos_ids(folder, hf)[:1] or [hf.bos_token_id]
    return [separator + hf(text, add_special_tokens=False).input_ids for text in texts]


def _batches(docs: list[list[int]], batch: int, pad: int):
    """Batches of documents of similar length (sorted, so little of each batch is padding); `keep` marks
    the positions whose next token is text: those positions' logits predict it."""
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    for start in range(0, len(docs), batch):
        group = [docs[i] for i in order[start:start + batch]]
        width = max(len(d) for d in group)
        tokens = torch.full((len(group), width), pad, dtype=torch.long)
        keep = torch.zeros(len(group), width, dtype=torch.bool)
        for row, doc in enumerate(group):
            tokens[row, :len(doc)] = torch.tensor(doc)
            keep[row, :len(doc) - 1] = True
        yield tokens, keep


def megatron_logits(chunks: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, padded vocab] of the one-process model, on the host with the batch's masks and targets (the
    scorer runs at TP=PP=1: a 50,000-token vocabulary's logits are too large to gather as objects, as the parity
    worker does)."""
    (gpt,) = chunks
    tokens = tokens.to(next(gpt.parameters()).device)  # the model's device (a GPU's: the batches are made on the host)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return gpt(tokens, positions, attention_mask=None).float().cpu()


def _load(ckpt: str, device):
    model, _ = checkpoint.read_config(ckpt)
    chunks = build_model(model, ParallelConfig(), PrecisionConfig(), device, 0, initialize=False)
    checkpoint.load(chunks, ckpt)
    for chunk in chunks:
        chunk.eval()
    return model, chunks


def score(job: ScoreJob, device) -> dict[str, Any]:
    """Bits per character of every checkpoint on every text set; logits comparisons for the pairs."""
    bits: dict[str, dict[str, float]] = {}
    for ckpt in job.checkpoints:
        model, chunks = _load(ckpt, device)
        folder = Path(ckpt) / checkpoint.HF_ASSETS
        bits[ckpt] = {}
        for name, texts in job.texts.items():
            docs = _documents(folder, texts)
            nats = 0.0
            for tokens, keep in _batches(docs, job.batch, docs[0][0]):
                # fp32 cross entropy of the text positions only (2e-6 nats from a float64 log-softmax, 3x
                # faster over a 49k-token vocabulary), summed in float64
                nll = torch.nn.functional.cross_entropy(megatron_logits(chunks, tokens)[keep], tokens.roll(-1, 1)[keep],
                                                        reduction="none")
                nats += float(nll.double().sum())
            bits[ckpt][name] = nats / math.log(2) / sum(len(t) for t in texts)
    groups: dict[tuple[str, str], list[int]] = {}  # pairs sharing a base and texts share its forward passes
    for index, (base, _, text) in enumerate(job.pairs):
        groups.setdefault((base, text), []).append(index)
    pairs: list[dict[str, Any]] = [{} for _ in job.pairs]
    for (base, text), indices in groups.items():
        figures = _compare(base, [job.pairs[i][1] for i in indices], job.texts[text], job.batch, device)
        for index, result in zip(indices, figures):
            pairs[index] = result
    return {"bits_per_char": bits, "pairs": pairs}


def _compare(base: str, extended: list[str], texts: list[str], batch: int, device) -> list[dict[str, Any]]:
    """Each extended checkpoint's logits against the base's on the texts both tokenize identically
    (the base runs once for every extended checkpoint whose tokenizer selects the same texts)."""
    old_docs = _documents(Path(base) / checkpoint.HF_ASSETS, texts)
    same = {ckpt: [a for a, b in zip(old_docs, _documents(Path(ckpt) / checkpoint.HF_ASSETS, texts)) if a == b]
            for ckpt in extended}
    old_model, old_chunks = _load(base, device)
    results = {}
    for docs in {tuple(map(tuple, docs)): docs for docs in same.values()}.values():
        members = [ckpt for ckpt in extended if same[ckpt] == docs]
        models = {ckpt: _load(ckpt, device) for ckpt in members}
        figures = {ckpt: {"max_abs_diff_old_entries": 0.0, "kl": 0.0, "new_mass": 0.0, "padding_mass": 0.0}
                   for ckpt in members}
        positions = 0
        for tokens, keep in _batches(docs, batch, docs[0][0]) if docs else ():
            old = megatron_logits(old_chunks, tokens)[keep][:, :old_model.vocab_size].double()
            p_old = torch.log_softmax(old, -1)
            for ckpt, (new_model, new_chunks) in models.items():
                new = megatron_logits(new_chunks, tokens)[keep].double()
                fig = figures[ckpt]
                fig["max_abs_diff_old_entries"] = max(fig["max_abs_diff_old_entries"],
                                                      float((old - new[:, :old_model.vocab_size]).abs().max()))
                p_new = torch.log_softmax(new, -1)
                fig["kl"] += float((p_old.exp() * (p_old - p_new[:, :old_model.vocab_size])).sum())
                fig["new_mass"] += float(p_new[:, old_model.vocab_size:new_model.vocab_size].exp().sum())
                fig["padding_mass"] += float(p_new[:, new_model.vocab_size:].exp().sum())
            positions += len(old)
        for ckpt, fig in figures.items():
            for key in ("kl", "new_mass", "padding_mass"):
                fig[key] /= max(positions, 1)
            results[ckpt] = fig | {
                "base": base, "extended": ckpt, "texts": len(texts), "identical_tokenization": len(docs),
                "positions": positions, "bitwise_equal_old_entries": fig["max_abs_diff_old_entries"] == 0}
    return [results[ckpt] for ckpt in extended]


@worker.entry(ScoreJob)
def main(job: ScoreJob) -> dict[str, Any]:
    with worker.session(ParallelConfig(), seed=0) as device:
        return score(job, device)


if __name__ == "__main__":
    main()
