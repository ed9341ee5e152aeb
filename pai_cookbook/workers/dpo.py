"""The preference-tuning worker: DPO, IPO or SimPO on pairs of answers, through the training worker's DDP, optimizer
(LoRA's adapters included) and pipeline schedule.

Its job is a `core.launching.jobs.DPOJob`. Every step draws `global_batch_size` pairs (passes over the set, each in an
order seeded by (seed, pass)), gives each data-parallel rank its share and runs them as micro-batches of
`micro_batch_size` pairs: the chosen sequences, then the rejected ones, right-padded to one width. The model's
per-token losses (Megatron-Core's vocabulary-parallel cross entropy, so no rank gathers logits) summed over each
answer's tokens are minus its log-probability; the reference's come with the job. The pair losses
(`core.rl.preference`) are summed and scaled to their share of the global per-pair mean
(`workers.training.per_token_scale` with one count per pair). Held-out pairs are scored forward-only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from pai_cookbook.core.configs.rlhf_config import DPOConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import DPOJob
from pai_cookbook.core.rl import preference
from pai_cookbook.workers import pair_steps, training

FIGURES = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp")
Pair = tuple[list[list[int]], list[int], list[float]]
"""([chosen ids, rejected ids], [their answers' starts], [their reference log-probabilities])"""


def pairs_of(job: DPOJob, split: str) -> list[Pair]:
    return list(zip(*(getattr(job, f"{split}_{key}") for key in ("ids", "starts", "reference"))))


def pair_batch(job: DPOJob, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """One micro-batch: rows [chosen of each pair..., rejected of each pair...], right-padded to the run's sequence
    length; `labels` the next tokens; `mask` 1 where the next token is an answer's; `reference` per row."""
    width = job.run.data.seq_length
    rows = [(p[0][side], p[1][side], p[2][side]) for side in (0, 1) for p in pairs]
    tokens = torch.full((len(rows), width), job.pad_id, dtype=torch.long)
    labels = torch.full_like(tokens, job.pad_id)
    mask = torch.zeros(len(rows), width)
    for row, (ids, start, _) in enumerate(rows):
        tokens[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(ids) - 1] = torch.tensor(ids[1:])
        mask[row, start - 1:len(ids) - 1] = 1.0
    return {"tokens": tokens, "labels": labels, "mask": mask, "reference": torch.tensor([r[2] for r in rows]),
            "loss_count": torch.tensor(float(len(pairs)))}


def micro_batches(job: DPOJob, pairs: list[Pair]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of `pairs`, in micro-batches."""
    return pair_steps.micro_batches(pairs, job.dpo.micro_batch_size, partial(pair_batch, job))


def _forward(config: DPOConfig, data_iterator, model):
    batch = next(data_iterator)
    return training.model_forward(model, batch), partial(_pair_loss, config, batch)


def _pair_loss(config: DPOConfig, batch: dict[str, Any], output: torch.Tensor):
    """The micro-batch's pair losses (summed, scaled to the global mean) and the sums behind the logged figures."""
    mask = batch["mask"].to(output.device)
    logp = -(output.float() * mask).sum(1)
    policy, reference, tokens = logp.chunk(2), batch["reference"].to(logp).chunk(2), mask.sum(1).chunk(2)
    losses, chosen, rejected = preference.losses(config, policy, reference, tokens)
    total = losses.sum()
    report = torch.stack([total, (chosen > rejected).sum().to(total), (chosen - rejected).sum(), chosen.sum(),
                          rejected.sum(), policy[0].sum(), policy[1].sum(), batch["loss_count"].to(total)])
    return total * batch.get("loss_scale", 1.0), {"pairs": report.detach()}


def run_pairs(job: DPOJob, model, batches: list[dict[str, Any]], forward_only: bool):
    return pair_steps.run(job.run, model, batches, partial(_forward, job.dpo), job.dpo.micro_batch_size, forward_only)


def _figures(reports) -> dict[str, float]:
    sums = training.global_sums(reports, "pairs", len(FIGURES) + 1).tolist()
    count = max(sums[-1], 1.0)
    return {name: value / count for name, value in zip(FIGURES, sums)}


def evaluate(job: DPOJob, model) -> dict[str, float]:
    """The figures over every held-out pair that fills whole micro-batches (on every rank)."""
    reports, usable = pair_steps.held_out(job.run, model, pairs_of(job, "valid"), job.dpo.micro_batch_size,
                                          partial(pair_batch, job), partial(_forward, job.dpo))
    return _figures(reports) | {"pairs": usable}


def train(job: DPOJob, device) -> dict[str, Any]:
    model, optimizer, scheduler = training.build(job.run, device)
    return pair_steps.train(
        job.run, device, model, optimizer, scheduler, pairs=pairs_of(job, "train"), per_step=job.dpo.global_batch_size,
        batches_of=partial(micro_batches, job), run_pairs=partial(run_pairs, job), figures=_figures,
        evaluate=partial(evaluate, job, model) if job.valid_ids else None, interval=job.dpo.eval_interval,
        evaluate_first=True)


@worker.entry(DPOJob)
def main(job: DPOJob) -> dict[str, Any]:
    with worker.session(job.run.parallel, job.run.seed) as device:
        return train(job, device)


if __name__ == "__main__":
    main()
