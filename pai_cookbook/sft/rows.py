"""Rows: conversations packed into sequences (first-fit decreasing, attention kept inside each) or padded one per
row, and a global batch's loss as each micro-batch split reports it. What training reads back from a prepared set
(global batches, per-token loss weights, the attention kept inside each conversation) is `core.text.sft_data`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pai_cookbook.core.text.sft_data import SFTError
from pai_cookbook.sft.records import Sample


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins of at most `capacity` tokens, no item
    split. Longest first, each into the first bin it fits; within a bin in that order.

    Raises:
        SFTError: an item is longer than `capacity` (drop or truncate it first: `encode_all`).
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise SFTError(f"items {too_long[:5]} are longer than the pack capacity {capacity}; encode_all drops or "
                       f"truncates them.")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def efficiency(lengths: Sequence[int], capacity: int, packed: bool) -> float:
    """Fraction of the tokens in the sequences that are real: packed into `pack`'s bins, or one sample per
    sequence padded to `capacity`."""
    sequences = len(pack(lengths, capacity)) if packed else len(lengths)
    return sum(lengths) / (sequences * capacity) if sequences else 0.0


# --------------------------------------------------------------------------------------------------
# Batches: packed (several conversations per sequence, attention kept inside each) or padded
# --------------------------------------------------------------------------------------------------
def batch(samples: Sequence[Sample], rows: Sequence[Sequence[int]], seq_length: int, pad_id: int) -> dict[str, Any]:
    """Model inputs for `rows` (each a list of indices into `samples`, packed in that order into one
    sequence of `seq_length`): tokens, labels, loss_mask and `document` (which conversation each position
    belongs to, -1 for padding), from which `attention_mask` builds the block-diagonal causal mask.

    A sample of n ids fills n - 1 positions: inputs ids[:-1], labels ids[1:], trained where its mask says.
    Padded batches are the same with one sample per row.
    """
    import torch

    shape = (len(rows), seq_length)
    tokens, labels = torch.full(shape, pad_id, dtype=torch.long), torch.full(shape, pad_id, dtype=torch.long)
    loss_mask, document = torch.zeros(shape), torch.full(shape, -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            ids, mask = samples[i].ids, samples[i].loss_mask
            n = len(ids) - 1
            if at + n > seq_length:
                raise SFTError(f"row {r} holds {at + n} positions, more than seq_length {seq_length}; pack with "
                               f"capacity seq_length over len(ids) - 1.")
            tokens[r, at:at + n] = torch.tensor(ids[:-1])
            labels[r, at:at + n] = torch.tensor(ids[1:])
            loss_mask[r, at:at + n] = torch.tensor(mask[1:], dtype=torch.float)
            document[r, at:at + n] = d
            at += n
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "document": document}


def loss_by_split(token_losses: Any, loss_mask: Any, micro_batch_sizes: Sequence[int]) -> dict[int, dict[str, float]]:
    """The loss of one global batch ([rows, seq] per-token losses and 0/1 mask) as each micro-batch size
    would report it: per token over the whole batch (Megatron-Core's per-token loss: the same for every
    split) and as the mean of micro-batch means (what a loop that averages per micro-batch reports and
    trains on: rows with fewer loss tokens weigh more, by an amount that depends on the split)."""
    losses, mask = token_losses.double(), loss_mask.double()
    out = {}
    for size in micro_batch_sizes:
        means = [float((losses[i:i + size] * mask[i:i + size]).sum() / mask[i:i + size].sum())
                 for i in range(0, losses.shape[0], size)]
        out[size] = {"per_token": float((losses * mask).sum() / mask.sum()), "mean_of_means": sum(means) / len(means)}
    return out


