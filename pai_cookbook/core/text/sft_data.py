"""A prepared SFT set (`DataConfig(source="sft")`) as training reads it: its summary (`describe`), its rows (`load`),
a step's micro-batches with their loss weights (`global_batch`, `loss_weights`), what validation reads
(`validation_batches`), and the two ways attention is kept inside each conversation of a packed row (`thd` for
Transformer Engine, `attention_mask` for the local spec). The SFT recipe (`pai_cookbook.sft`) writes such sets and
checks them before launch; the training workers read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pai_cookbook.core.launching import inputs

SUMMARY = "sft.json"


class SFTError(ValueError):
    """Bad SFT input, named before any worker starts: where, what was expected, what was found."""


def describe(folder: str | Path) -> dict[str, Any]:
    """The summary of a prepared set; a clear error when the folder is not one."""
    path = Path(folder) / SUMMARY
    if not path.exists():
        raise SFTError(f"{folder} is not a prepared SFT set (no {SUMMARY}); write it with sft.prepare(...).")
    return inputs.read_json(path, fix="Prepare the set again with sft.prepare(...).", error=SFTError)


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


def validation_batches(config: Any) -> list[dict[str, Any]]:
    """The global batches a run's validation reads (`config.eval_iters` of them, the held-out rows in order), each
    whole as one batch with the run's loss weights: what another engine scores to reproduce the run's validation
    loss (the mean over batches of each batch's weighted loss sum over its `loss_count`). `config` is the RunConfig
    of an SFT run (`DataConfig(source="sft")`)."""
    rows, gbs = load(config.data.paths[0], "valid"), config.data.global_batch_size
    return [global_batch(rows, step, gbs, gbs, 0, 1, config.seed, config.data.loss_average, shuffle=False)[0]
            for step in range(config.eval_iters)]


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
