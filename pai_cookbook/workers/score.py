"""The scoring worker: bits per character of checkpoints on texts, and an extended model against its base.

Its job is a `pai_cookbook.extend.ScoreJob`. Per-token losses of models with different tokenizers are
not comparable (a token is a different amount of text); bits per character are: each text is scored
as [separator] + its tokens under the checkpoint's own tokenizer, so every character is predicted from
the same context, and the total is divided by the characters. For a pair (base, extended), the two
models' logits on the same token ids are compared: old entries (bitwise), the full-softmax KL, and
the probability mass on the new and on the padding rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core import checkpoint, tokenizer, worker
from pai_cookbook.core.config import ParallelConfig, PrecisionConfig
from pai_cookbook.core.model import build_model
from pai_cookbook.extend import ScoreJob


def _documents(folder: Path, texts: list[str]) -> list[list[int]]:
    """Each text as [separator] + its tokens: every token of the text is predicted, from the same context."""
    hf = tokenizer.load(folder)
    separator = tokenizer.eos_ids(folder, hf)[:1] or [hf.bos_token_id]
    return [separator + hf(text, add_special_tokens=False).input_ids for text in texts]


def _batches(docs: list[list[int]], batch: int, pad: int):
    for start in range(0, len(docs), batch):
        group = docs[start:start + batch]
        width = max(len(d) for d in group)
        tokens = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        for row, doc in enumerate(group):
            tokens[row, :len(doc)] = torch.tensor(doc)
            mask[row, 1:len(doc)] = True  # predicted positions (targets), shifted below
        yield tokens, mask


def megatron_logits(chunks: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, padded vocab] of the one-process model (the scorer runs at TP=PP=1: a
    50,000-token vocabulary's logits are too large to gather as objects, as the parity worker does)."""
    (gpt,) = chunks
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return gpt(tokens, positions, attention_mask=None).float()


def _load(ckpt: str, device):
    model, _ = checkpoint.read_config(ckpt)
    chunks = build_model(model, ParallelConfig(), PrecisionConfig(), device, 0)
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
            for tokens, mask in _batches(docs, job.batch, docs[0][0]):
                logits = megatron_logits(chunks, tokens)[:, :-1]
                # fp32 cross entropy per token (2e-6 nats from a float64 log-softmax, 3x faster over a
                # 49k-token vocabulary), summed in float64
                nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                                                        reduction="none").view(len(tokens), -1)
                nats += float(nll[mask[:, 1:]].double().sum())
            bits[ckpt][name] = nats / math.log(2) / sum(len(t) for t in texts)
    pairs = [_compare(base, extended, job.texts[text], job.batch, device) for base, extended, text in job.pairs]
    return {"bits_per_char": bits, "pairs": pairs}


def _compare(base: str, extended: str, texts: list[str], batch: int, device) -> dict[str, Any]:
    """The extended checkpoint's logits against the base's on texts both tokenize identically."""
    old_docs = _documents(Path(base) / checkpoint.HF_ASSETS, texts)
    new_docs = _documents(Path(extended) / checkpoint.HF_ASSETS, texts)
    same = [a for a, b in zip(old_docs, new_docs) if a == b]
    old_model, old_chunks = _load(base, device)
    new_model, new_chunks = _load(extended, device)
    old_vocab, new_vocab = old_model.vocab_size, new_model.vocab_size
    figures = {"max_abs_diff_old_entries": 0.0, "kl": 0.0, "new_mass": 0.0, "padding_mass": 0.0}
    positions = 0
    for tokens, mask in _batches(same, batch, same[0][0]):
        old, new = megatron_logits(old_chunks, tokens), megatron_logits(new_chunks, tokens)
        keep = mask.roll(-1, 1)  # logits at positions whose next token is real text
        old, new = old[keep].double(), new[keep].double()
        figures["max_abs_diff_old_entries"] = max(figures["max_abs_diff_old_entries"],
                                                  float((old[:, :old_vocab] - new[:, :old_vocab]).abs().max()))
        p_old = torch.log_softmax(old[:, :old_vocab], -1)
        p_new = torch.log_softmax(new, -1)
        figures["kl"] += float((p_old.exp() * (p_old - p_new[:, :old_vocab])).sum())
        figures["new_mass"] += float(p_new[:, old_vocab:new_vocab].exp().sum())
        figures["padding_mass"] += float(p_new[:, new_vocab:].exp().sum())
        positions += len(old)
    for key in ("kl", "new_mass", "padding_mass"):
        figures[key] /= max(positions, 1)
    return figures | {"base": base, "extended": extended, "texts": len(texts), "identical_tokenization": len(same),
                      "positions": positions, "bitwise_equal_old_entries": figures["max_abs_diff_old_entries"] == 0}


@worker.entry(ScoreJob)
def main(job: ScoreJob) -> dict[str, Any]:
    with worker.session(ParallelConfig(), seed=0) as device:
        return score(job, device)


if __name__ == "__main__":
    main()
