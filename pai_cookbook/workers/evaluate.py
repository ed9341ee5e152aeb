"""The evaluation worker: log-probabilities of scored tokens under a checkpoint at any layout (`EvalJob`).

Each sequence is fed without its last token; the log-probability of each scored token is read at the position before
it, with whether it is the model's greedy choice there. Nothing vocabulary-wide leaves a tensor-parallel rank: each
holds a slice of the vocabulary's logits, and the log-softmax and argmax are reduced over the slices (a 50,000-token
vocabulary's logits at 2,048 positions are 400 MB per sequence in fp32; the scores are two numbers per position).
Megatron-Core's vocabulary padding rows are not tokens: they are masked out, as the Hugging Face model has none.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import EvalJob
from pai_cookbook.workers import forward
from pai_cookbook.workers.models import build_model

PAD = 0
"""Any id: padding sits after every scored position, which causal attention never lets it reach."""


def vocab_parallel_scores(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of `targets`, whether each is the argmax) per position, from this tensor-parallel rank's slice
    of the logits [batch, seq, vocab / TP], reduced over the slices; the argmax is the first index of the maximum, as
    torch's is."""
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    logits = logits.float()
    width = logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * width
    ids = torch.arange(first, first + width, device=logits.device)
    logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    local_max, local_arg = logits.max(-1)
    maxes = [torch.empty_like(local_max) for _ in range(tp)]
    args = [torch.empty_like(local_arg) for _ in range(tp)]
    torch.distributed.all_gather(maxes, local_max, group=group)
    torch.distributed.all_gather(args, local_arg + first, group=group)
    maxes, args = torch.stack(maxes), torch.stack(args)
    top = maxes.max(0).values
    winner = (maxes == top).to(torch.uint8).argmax(0, keepdim=True)  # the first slice holding the maximum
    greedy = args.gather(0, winner)[0] == targets
    summed = (logits - top.unsqueeze(-1)).exp().sum(-1)
    torch.distributed.all_reduce(summed, group=group)
    mine = (targets >= first) & (targets < first + width)
    picked = logits.gather(-1, (targets - first).clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(mine, picked, torch.zeros_like(picked))
    torch.distributed.all_reduce(target_logit, group=group)
    return target_logit - top - summed.log(), greedy


def score_batch(chunks: list[torch.nn.Module], tokens: torch.Tensor, targets: torch.Tensor, vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`vocab_parallel_scores` of one batch on the last pipeline stage, returned on global rank 0 (None elsewhere)."""
    targets = targets.to(next(chunks[0].parameters()).device)

    def collect(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, greedy = vocab_parallel_scores(output, targets, vocab_size)
        return logprobs.cpu(), greedy.cpu()
    return forward.last_stage(chunks, tokens, collect)


def batches(job: EvalJob, multiple: int):
    """(indices, fed tokens, targets) of batches of similar length (longest first), each padded to a multiple of
    `multiple` positions (sequence parallelism splits the sequence over TP)."""
    order = sorted(range(len(job.sequences)), key=lambda i: -len(job.sequences[i]))
    for start in range(0, len(order), job.batch):
        picked = order[start:start + job.batch]
        width = -(-max(len(job.sequences[i]) - 1 for i in picked) // multiple) * multiple
        tokens = torch.full((len(picked), width), PAD, dtype=torch.long)
        targets = torch.full((len(picked), width), PAD, dtype=torch.long)
        for row, i in enumerate(picked):
            ids = torch.tensor(job.sequences[i])
            tokens[row, :len(ids) - 1], targets[row, :len(ids) - 1] = ids[:-1], ids[1:]
        yield picked, tokens, targets


def evaluate(job: EvalJob, device) -> dict[str, Any] | None:
    model, _ = checkpoint.read_config(job.ckpt)
    start = time.perf_counter()
    chunks = build_model(model, job.parallel, job.precision, device, 0, initialize=False)
    checkpoint.load(chunks, job.ckpt)
    for chunk in chunks:
        chunk.eval()
    loaded = time.perf_counter()
    results: list[dict[str, Any]] = [{} for _ in job.sequences]
    multiple = job.parallel.tensor_model_parallel_size if job.parallel.sequence_parallel else 1
    positions = 0
    for done, (picked, tokens, targets) in enumerate(batches(job, multiple), start=1):
        scores = score_batch(chunks, tokens, targets, model.vocab_size)
        positions += tokens.numel()
        if scores is not None:
            logprobs, greedy = scores
            for row, i in enumerate(picked):
                end = len(job.sequences[i]) - 1
                span = slice(end - job.scored[i], end)
                results[i] = {"logprob": float(logprobs[row, span].double().sum()),
                              "greedy": bool(greedy[row, span].all()),
                              "token_logprobs": logprobs[row, span].tolist()}
        worker.progress(min(done * job.batch, len(job.sequences)), len(job.sequences))
    if torch.distributed.get_rank() != 0:
        return None
    scored = time.perf_counter()
    return {"results": results, "seconds": {"load": loaded - start, "score": scored - loaded},
            "positions": positions, "sequences_per_s": len(job.sequences) / max(scored - loaded, 1e-9)}


@worker.entry(EvalJob)
def main(job: EvalJob) -> dict[str, Any] | None:
    with worker.session(job.parallel, seed=0) as device:
        return evaluate(job, device)


if __name__ == "__main__":
    main()
