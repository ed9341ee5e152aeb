"""The policy's and the critic's updates for the RL worker (a library beside it): rollouts as training rows, their
log-probabilities from Megatron-Core's own forward, GRPO's and PPO's clipped losses through Megatron-Core's pipeline
schedule, and PPO's advantages (GAE over per-token rewards with the KL penalty)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from pai_cookbook.core.launching.jobs import RLJob
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.rl import rl_math
from pai_cookbook.workers import training


def read_score(batch: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
    return output[torch.arange(output.shape[0], device=output.device), batch["end"].to(output.device), 0].float()


def read_values(batch: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
    return output[..., 0].float()


def _read_logprobs(batch: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
    return -output.float()


def rows(job: RLJob, rollouts: list[dict[str, Any]], prompt_ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """[rows, longest prompt + max_new_tokens] training rows: prompt + completion, labels shifted by one,
    `loss_mask` on the positions that predict a completion token, `end` the last token's position, the
    engine's log-probabilities of the same tokens (`engine_mask`: where the rollout has them)."""
    n, width = len(rollouts), job.run.data.seq_length
    tokens = torch.full((n, width), job.pad_id, dtype=torch.long)
    labels = torch.full((n, width), job.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(n, width)
    engine = torch.zeros(n, width)
    engine_mask = torch.zeros(n, width)
    end = torch.zeros(n, dtype=torch.long)
    for row, rollout in enumerate(rollouts):
        prompt = prompt_ids[rollout["prompt"]]
        sequence = prompt + rollout["tokens"]
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        labels[row, :len(sequence) - 1] = torch.tensor(sequence[1:])
        loss_mask[row, len(prompt) - 1:len(sequence) - 1] = 1.0
        end[row] = len(sequence) - 1
        sampled = rollout.get("engine_logprobs") or []
        engine[row, len(prompt) - 1:len(prompt) - 1 + len(sampled)] = torch.tensor(sampled)
        engine_mask[row, len(prompt) - 1:len(prompt) - 1 + len(sampled)] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "end": end, "engine_logprobs": engine,
            "engine_mask": engine_mask}


def micro_batches(job: RLJob, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the batch's rows, in micro-batches."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = batch["tokens"].shape[0] // dp_size
    mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
    size = job.config.micro_batch_size
    out = []
    for start in range(0, per_rank, size):
        mb = {k: v[start:start + size] for k, v in mine.items()}
        mb["loss_count"] = mb["loss_mask"].sum()
        out.append(mb)
    return out


def _keep_forward(read, data_iterator, model):
    batch = next(data_iterator)
    return training.model_forward(model, batch, labels=read is _read_logprobs), partial(_keep, read, batch)


def _keep(read, batch: dict[str, Any], output: torch.Tensor):
    return output.sum() * 0.0, {"kept": read(batch, output).detach()}


def forward_only(model: list[torch.nn.Module], job: RLJob, batches: list[dict[str, torch.Tensor]],
                  read) -> list[torch.Tensor]:
    """`read(batch, output)` of each micro-batch, without gradients (on the last pipeline stage; an empty list
    on the others): log-probabilities of the labels, values, or scores."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    modes = [chunk.training for chunk in model]  # frozen models stay in eval mode
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=partial(_keep_forward, read), data_iterator=iter(batches), model=model[0],
            num_microbatches=len(batches), seq_length=job.run.data.seq_length,
            micro_batch_size=job.config.micro_batch_size, decoder_seq_length=job.run.data.seq_length, forward_only=True)
    for chunk, mode in zip(model, modes):
        chunk.train(mode)
    return [s["kept"].cpu() for s in stored]


def logprobs(model: list[torch.nn.Module], job: RLJob, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Per-token log-probabilities of each micro-batch's labels, without gradients (last pipeline stage)."""
    return forward_only(model, job, batches, _read_logprobs)


def _policy_forward(data_iterator, model):
    batch = next(data_iterator)
    return training.model_forward(model, batch), partial(_policy_loss, batch)


def _policy_loss(batch: dict[str, Any], output: torch.Tensor):
    """The clipped surrogate + kl_coef x KL of the micro-batch's completion tokens, summed and scaled to its
    share of the global per-token mean; the sums behind the logged figures."""
    logprobs = -output.float()
    mask = batch["loss_mask"].to(logprobs)
    surrogate, clipped = rl_math.clipped_surrogate(logprobs, batch["old_logprobs"].to(logprobs),
                                                   batch["advantages"].to(logprobs), batch["clip"])
    kl = rl_math.kl(logprobs, batch["ref_logprobs"].to(logprobs), batch["kl_estimator"])
    total = ((surrogate + batch["kl_loss_coef"] * kl) * mask).sum()
    report = torch.stack([total, (surrogate * mask).sum(), (kl * mask).sum(), (clipped * mask).sum(), mask.sum()])
    return total * batch["loss_scale"], {"policy": report.detach()}


def _value_forward(data_iterator, model):
    batch = next(data_iterator)
    return training.model_forward(model, batch, labels=False), partial(_value_loss, batch)


def _value_loss(batch: dict[str, Any], output: torch.Tensor):
    """PPO's clipped value loss of the micro-batch's completion tokens, summed and scaled like the policy's."""
    values = read_values(batch, output)
    mask = batch["loss_mask"].to(values)
    error, clipped = rl_math.clipped_value_error(values, batch["old_values"].to(values), batch["returns"].to(values),
                                                 batch["value_clip"])
    total = (error * mask).sum()
    return total * batch["loss_scale"], {"value": torch.stack([total, (clipped * mask).sum(), mask.sum()]).detach()}


def max_over_world(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=runtime.collective_device())
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


def _optimizer_step(job: RLJob, model, optimizer, scheduler, batches, forward) -> tuple[list[dict], float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    stored = get_forward_backward_func()(
        forward_step_func=forward, data_iterator=iter(batches), model=model[0], num_microbatches=len(batches),
        seq_length=job.run.data.seq_length, micro_batch_size=job.config.micro_batch_size,
        decoder_seq_length=job.run.data.seq_length, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return stored, float(grad_norm or 0.0)


def update(job: RLJob, model, optimizer, scheduler, batches: list[dict[str, Any]], critic=None) -> list[dict[str, float]]:
    """`epochs` optimizer steps on the batch (and, with a critic, a critic step after each); per step the
    losses, their parts and the gradient norms."""
    g = job.config
    scale = training.per_token_scale(batches)
    batches = [b | {"loss_scale": scale, "clip": g.clip, "kl_estimator": g.kl_estimator,
                    "kl_loss_coef": 0.0 if job.ppo is not None else g.kl_coef,  # PPO's KL is in the reward
                    "value_clip": getattr(g, "value_clip", 0.0)} for b in batches]
    figures = []
    for _ in range(g.epochs):
        stored, grad_norm = _optimizer_step(job, model, optimizer, scheduler, batches, _policy_forward)
        total, surrogate, kl, clipped, count = training.global_sums(stored, "policy", 5).tolist()
        count = max(count, 1.0)
        figure = {"loss": total / count, "policy_loss": surrogate / count, "kl": kl / count,
                  "clip_fraction": clipped / count, "grad_norm": grad_norm}
        if critic is not None:
            stored, grad_norm = _optimizer_step(job, *critic, batches, _value_forward)
            total, clipped, count = training.global_sums(stored, "value", 3).tolist()
            count = max(count, 1.0)
            figure |= {"value_loss": total / count, "value_clip_fraction": clipped / count,
                       "critic_grad_norm": grad_norm}
        figures.append(figure)
    return figures


def ppo_advantages(job: RLJob, batches: list[dict[str, Any]], kl_coef: float) -> dict[str, float]:
    """PPO's per-token rewards, GAE advantages and returns of each micro-batch (in place, on the last pipeline
    stage: `old_logprobs`, `ref_logprobs`, `old_values` and `score` are there); the advantages whitened over
    the global batch. Returns the global figures: the KL per completion and the critic's explained variance."""
    from megatron.core import parallel_state as ps

    g = job.config
    sums = []
    for mb in batches:
        mask = mb["loss_mask"]
        kl = rl_math.kl(mb["old_logprobs"], mb["ref_logprobs"], g.kl_estimator) * mask
        token_rewards = -kl_coef * kl
        token_rewards[torch.arange(mask.shape[0]), mb["end"] - 1] += mb["score"]  # the last completion token
        advantages, returns = rl_math.gae(token_rewards, mb["old_values"], mask, g.gamma, g.lam)
        residual = (returns - mb["old_values"]) * mask
        mb["advantages"], mb["returns"] = advantages, returns
        sums.append({"ppo": torch.stack([advantages.sum(), (advantages ** 2).sum(), mask.sum(), kl.sum(),
                                         torch.tensor(float(mask.shape[0])), returns.sum(), (returns ** 2).sum(),
                                         residual.sum(), (residual ** 2).sum()]).double()})
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    a1, a2, count, kl, completions, r1, r2, e1, e2 = training.global_sums(sums if last_stage else [], "ppo", 9).tolist()
    count = max(count, 1.0)
    if g.whiten_advantages:
        mean, variance = a1 / count, (a2 - a1 * a1 / count) / max(count - 1, 1.0)
        for mb in batches:
            mb["advantages"] = rl_math.whiten(mb["advantages"], mb["loss_mask"], (mean, variance))
    returns_variance = r2 / count - (r1 / count) ** 2
    residual_variance = e2 / count - (e1 / count) ** 2
    return {"kl_sequence": kl / max(completions, 1.0),
            "explained_variance": 1 - residual_variance / returns_variance if returns_variance > 0 else None}


