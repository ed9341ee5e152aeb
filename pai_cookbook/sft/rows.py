"""Rows: conversations packed into sequences (first-fit decreasing, attention kept inside each) or padded one per
row, and what training reads back from a prepared set: global batches and per-token loss weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.chat_template import SFTError
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


def thd(batch: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch of packed rows as Megatron-Core's THD packed sequence (Transformer Engine): the rows
    laid end to end as one row, `cu_seqlens` the offsets where each conversation (and each row's padding
    tail) starts, plus the total, and `max_seqlen` the longest. Attention and rotary positions then restart
    at every offset; per-position tensors keep their order, so losses line up with the loss mask."""
    import torch

    rows, seq = batch["tokens"].shape
    segment = (torch.arange(rows)[:, None] * (seq + 1) + batch["document"] + 1).reshape(-1)  # unique per (row, doc)
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[1:] = segment[1:] != segment[:-1]
    cu_seqlens = torch.cat([torch.nonzero(starts).view(-1), torch.tensor([rows * seq])]).to(torch.int32)
    out = {key: value.reshape(1, -1) if torch.is_tensor(value) and value.dim() == 2 else value
           for key, value in batch.items() if key != "document"}
    return out | {"cu_seqlens": cu_seqlens, "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}


def attention_mask(document: Any) -> Any:
    """Megatron-Core's boolean attention mask [batch, 1, seq, seq] (True: masked) that keeps attention causal
    and inside each conversation of a packed row; a padding position sees only itself.

    With this mask rotary embeddings need no per-conversation reset: RoPE scores depend only on the distance
    between two positions, which packing does not change inside a conversation (tests compare packed and
    padded logits).
    """
    import torch

    seq = document.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document.device).tril()
    same = document[:, :, None] == document[:, None, :]
    pad_self = torch.eye(seq, dtype=torch.bool, device=document.device) & (document < 0)[:, :, None]
    keep = (same & causal & (document >= 0)[:, :, None]) | pad_self
    return ~keep[:, None]


def load(folder: str | Path, split: str) -> dict[str, Any]:
    """The rows of one split of a prepared set: tokens, labels, loss_mask, document (int64 / float)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / f"{split}.safetensors"))
    return {k: v.float() if k == "loss_mask" else v.long() for k, v in tensors.items()}


def global_batch(rows: dict[str, Any], step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, average: str = "token", shuffle: bool = True) -> list[dict[str, Any]]:
    """This DP rank's micro-batches of global batch `step`: rows [step x GBS, (step + 1) x GBS) of a stream
    that runs through the set epoch after epoch, each epoch in its own seeded order (`shuffle`) or in
    order. The same rows at every layout, and a resumed run continues where it stopped.

    Each micro-batch carries `loss_mask` as loss weights and `loss_count`, what they sum to: per token
    (weights 0/1, the count of loss tokens) or per sample (each conversation's tokens weigh 1/its loss
    tokens, the count of conversations), so the global batch's loss is sum / count whatever the split.
    """
    import torch

    n = rows["tokens"].shape[0]
    per_rank = global_batch_size // dp_size
    first = step * global_batch_size + dp_rank * per_rank
    orders: dict[int, list[int]] = {}

    def row(k: int) -> int:
        epoch = k // n
        if epoch not in orders:
            orders[epoch] = (torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
                             .tolist() if shuffle else list(range(n)))
        return orders[epoch][k % n]

    picked = torch.tensor([row(k) for k in range(first, first + per_rank)])
    out = []
    for i in range(0, per_rank, micro_batch_size):
        mb = {key: value[picked[i:i + micro_batch_size]] for key, value in rows.items()}
        mb["loss_mask"], mb["loss_count"] = loss_weights(mb["loss_mask"], mb["document"], average)
        out.append(mb)
    return out


def loss_weights(loss_mask: Any, document: Any, average: str) -> tuple[Any, Any]:
    """(weights, count) of a micro-batch: per token, the mask and its sum; per sample, each conversation's
    loss tokens weighted 1 / their number, and the number of conversations with a loss token."""
    import torch

    mask = loss_mask.float()
    if average == "token":
        return mask, mask.sum().round().int()
    if document is None:  # one sample per row
        document = torch.zeros_like(mask, dtype=torch.long)
    # a conversation is (row, document id): number them across the micro-batch
    key = torch.arange(mask.shape[0]).unsqueeze(1) * (int(document.max()) + 2) + document + 1
    sizes = torch.zeros(int(key.max()) + 1).index_add_(0, key.view(-1), mask.view(-1))
    per_token = sizes[key]
    weights = torch.where(mask > 0, mask / per_token.clamp(min=1), torch.zeros_like(mask))
    return weights, torch.tensor(int((sizes > 0).sum()), dtype=torch.int)


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


