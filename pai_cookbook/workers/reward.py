"""The reward-model worker: Bradley-Terry training of a GPT with a scalar head, through the training worker's
DDP, optimizer and pipeline schedule.

Its job is a `core.launching.jobs.RewardModelJob`. Every step draws `global_batch_size` pairs (passes
over the pair set, each in an order seeded by (seed, pass)), gives each data-parallel rank its share and
runs them as micro-batches of `micro_batch_size` pairs: the chosen sequences, then the rejected ones, right-
padded to one width. The model's scores at each sequence's last token make the pair's loss; the loss is
summed and scaled to its share of the global per-pair mean (`workers.training.per_token_scale` with one
count per pair). Held-out pairs are scored forward-only; their accuracy is the share of pairs whose chosen
sequence scores higher.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import RewardModelJob
from pai_cookbook.workers import pair_steps, training

Pair = tuple[list[int], list[int], float]
"""(chosen ids, rejected ids, margin)"""


def pairs_of(job: RewardModelJob, split: str) -> list[Pair]:
    ids, margins = (job.train_pairs, job.train_margins) if split == "train" else (job.valid_pairs, job.valid_margins)
    return [(chosen, rejected, margin) for (chosen, rejected), margin in zip(ids, margins)]


def pair_batch(job: RewardModelJob, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """One micro-batch: rows [chosen of each pair..., rejected of each pair...], right-padded to the run's
    sequence length; `last`: each row's last token; `margin` per pair; `loss_count`: the pairs."""
    width, rows = job.run.data.seq_length, [p[0] for p in pairs] + [p[1] for p in pairs]
    tokens = torch.full((len(rows), width), job.pad_id, dtype=torch.long)
    for row, ids in enumerate(rows):
        tokens[row, :len(ids)] = torch.tensor(ids)
    return {"tokens": tokens, "last": torch.tensor([len(ids) - 1 for ids in rows]),
            "margin": torch.tensor([p[2] for p in pairs]), "loss_count": torch.tensor(float(len(pairs)))}


def micro_batches(job: RewardModelJob, pairs: list[Pair]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of `pairs`, in micro-batches."""
    return pair_steps.micro_batches(pairs, job.rm.micro_batch_size, partial(pair_batch, job))


def _forward(data_iterator, model):
    batch = next(data_iterator)
    return training.model_forward(model, batch, labels=False), partial(_pair_loss, batch)


def _pair_loss(batch: dict[str, Any], output: torch.Tensor):
    """Bradley-Terry over the micro-batch's pairs (summed, scaled to the global mean), and the sums behind
    the logged loss, accuracy and margin; `scores` keeps each pair's (chosen, rejected) scores."""
    scores = output[torch.arange(output.shape[0], device=output.device), batch["last"].to(output.device), 0].float()
    chosen, rejected = scores.chunk(2)
    difference = chosen - rejected
    losses = -torch.nn.functional.logsigmoid(difference - batch["margin"].to(difference))
    total = losses.sum()
    report = torch.stack([total, (difference > 0).sum().to(total), difference.sum(), batch["loss_count"].to(total)])
    return total * batch.get("loss_scale", 1.0), {"pairs": report.detach(),
                                                   "scores": torch.stack([chosen, rejected], 1).detach().cpu()}


def run_pairs(job: RewardModelJob, model, batches: list[dict[str, Any]], forward_only: bool):
    return pair_steps.run(job.run, model, batches, _forward, job.rm.micro_batch_size, forward_only)


def _figures(reports) -> dict[str, float]:
    total, correct, margin, count = training.global_sums(reports, "pairs", 4).tolist()
    count = max(count, 1.0)
    return {"loss": total / count, "accuracy": correct / count, "margin": margin / count}


def evaluate(job: RewardModelJob, model) -> tuple[dict[str, float], list[list[float]]]:
    """Held-out loss and accuracy over every held-out pair, and their (chosen, rejected) scores in order
    (on every rank)."""
    reports, usable = pair_steps.held_out(job.run, model, pairs_of(job, "valid"), job.rm.micro_batch_size,
                                          partial(pair_batch, job), _forward)
    scores = training.gather_rows(torch.cat([r["scores"] for r in reports]).tolist() if reports else None)
    return _figures(reports) | {"pairs": usable}, scores


def train(job: RewardModelJob, device) -> dict[str, Any]:
    model, optimizer, scheduler = training.build(job.run, device, head="reward")
    scores: list[list[float]] = []  # the held-out pairs' (chosen, rejected) scores at the latest evaluation

    def held_out() -> dict[str, float]:
        figures, scores[:] = evaluate(job, model)
        return figures

    result = pair_steps.train(
        job.run, device, model, optimizer, scheduler, pairs=pairs_of(job, "train"), per_step=job.rm.global_batch_size,
        batches_of=partial(micro_batches, job), run_pairs=partial(run_pairs, job), figures=_figures,
        evaluate=held_out if job.valid_pairs else None, interval=job.rm.eval_interval)
    return result | {"valid_scores": {"chosen": [s[0] for s in scores], "rejected": [s[1] for s in scores]}}


@worker.entry(RewardModelJob)
def main(job: RewardModelJob) -> dict[str, Any]:
    with worker.session(job.run.parallel, job.run.seed) as device:
        return train(job, device)


if __name__ == "__main__":
    main()
