"""The evaluation worker: log-probabilities of scored tokens under a checkpoint at any layout (`EvalJob`).

Each sequence is fed without its last token; the log-probability of each scored token is read at the position before
it, with whether it is the model's greedy choice there. Nothing vocabulary-wide leaves a tensor-parallel rank: each
holds a slice of the vocabulary's logits, and the log-softmax and argmax are reduced over the slices (a 50,000-token
vocabulary's logits at 2,048 positions are 400 MB per sequence in fp32; the scores are two numbers per position).
Megatron-Core's vocabulary padding rows are not tokens: they are masked out, as the Hugging Face model has none.

Requests that feed the same tokens and differ only in their last scored token (a multiple-choice question's " A",
" B", " C", " D" after one context) are one forward pass: the log-probabilities of every such last token are read at
the same position (`shared_inputs`; the harness's Hugging Face model caches these logits likewise). MMLU's four
requests per question cost one pass.
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


def score_batch(chunks: list[torch.nn.Module], tokens: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                last: torch.Tensor | None = None, finals: torch.Tensor | None = None) -> tuple | None:
    """`vocab_parallel_scores` of one batch on the last pipeline stage, returned on global rank 0 (None elsewhere); with
    `last` (each row's last fed position) and `finals` [rows, k] (ids), also the scores of each of those ids there."""
    device = next(chunks[0].parameters()).device
    targets = targets.to(device)

    def collect(output: torch.Tensor) -> tuple:
        logprobs, greedy = vocab_parallel_scores(output, targets, vocab_size)
        if finals is None:
            return logprobs.cpu(), greedy.cpu()
        at = output[torch.arange(output.shape[0], device=device), last.to(device)]  # [rows, vocab / TP]
        options = at.unsqueeze(1).expand(-1, finals.shape[1], -1)
        final_logprobs, final_greedy = vocab_parallel_scores(options, finals.to(device), vocab_size)
        return logprobs.cpu(), greedy.cpu(), final_logprobs.cpu(), final_greedy.cpu()
    return forward.last_stage(chunks, tokens, collect)


def shared_inputs(job: EvalJob) -> dict[int, list[int]]:
    """The sequences fed once (a representative's index) -> every request it answers: those whose tokens but the last
    are the same and which score as many tokens (so they differ in the last scored token at most)."""
    groups: dict[tuple, list[int]] = {}
    for i, ids in enumerate(job.sequences):
        groups.setdefault((tuple(ids[:-1]), job.scored[i]), []).append(i)
    return {members[0]: members for members in groups.values()}


def batches(job: EvalJob, multiple: int, fed: list[int]):
    """(indices, fed tokens, targets) of the sequences `fed` in batches of similar length (longest first), each padded
    to a multiple of `multiple` positions (sequence parallelism splits the sequence over TP)."""
    order = sorted(fed, key=lambda i: -len(job.sequences[i]))
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
    positions, answered = 0, 0
    groups = shared_inputs(job)
    for picked, tokens, targets in batches(job, multiple, list(groups)):
        last = torch.tensor([len(job.sequences[i]) - 2 for i in picked])
        width = max(len(groups[i]) for i in picked)
        finals = torch.tensor([[job.sequences[m][-1] for m in groups[i]] + [PAD] * (width - len(groups[i]))
                               for i in picked]) if width > 1 else None
        scores = score_batch(chunks, tokens, targets, model.vocab_size, last, finals)
        positions += tokens.numel()
        if scores is not None:
            logprobs, greedy = scores[:2]
            for row, i in enumerate(picked):
                end = len(job.sequences[i]) - 1
                span = slice(end - job.scored[i], end)
                for k, member in enumerate(groups[i]):
                    token_logprobs, flags = logprobs[row, span].clone(), greedy[row, span].clone()
                    if finals is not None:  # the member's own last token, read at the shared last position
                        token_logprobs[-1], flags[-1] = scores[2][row, k], scores[3][row, k]
                    results[member] = {"logprob": float(token_logprobs.double().sum()), "greedy": bool(flags.all()),
                                       "token_logprobs": token_logprobs.tolist()}
        answered += sum(len(groups[i]) for i in picked)
        worker.progress(answered, len(job.sequences))
    if torch.distributed.get_rank() != 0:
        return None
    scored = time.perf_counter()
    return {"results": results, "seconds": {"load": loaded - start, "score": scored - loaded},
            "positions": positions, "fed": len(groups), "sequences_per_s": len(job.sequences) / max(scored - loaded, 1e-9)}


@worker.entry(EvalJob)
def main(job: EvalJob) -> dict[str, Any] | None:
    with worker.session(job.parallel, seed=0) as device:
        return evaluate(job, device)


if __name__ == "__main__":
    main()
