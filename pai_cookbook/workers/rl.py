"""The RL worker: GRPO on Megatron-Core, rollouts from Megatron-Core's engine on the policy's own modules.

Its job is a `pai_cookbook.rlhf.GRPOJob`. One step (`grpo_step`):
1. `sample`: the static inference engine of notebook 07 (`workers.generate.build_engine`) over the very
   GPTModel the optimizer updates (DDP's `.module`), temperature 1, no top-k/top-p, seeded by (seed, step),
   returning each sampled token's log-probability. Every rank samples every completion (same seeds, same
   tokens); each data-parallel rank then trains on its share.
2. Rewards on global rank 0 (the user's function runs once per completion), broadcast; GRPO advantages.
3. Forward passes without gradients through Megatron-Core's pipeline schedule: the policy's log-probabilities
   (the "old" ones of the ratio) and the reference's. The engine's log-probabilities are compared with the
   policy's here: they are the same weights, so they must agree (KV-cached one-token steps against one full
   forward: float rounding only), and after an update a stale copy would not.
4. `epochs` optimizer steps on the clipped surrogate + kl_coef x KL, per token over the whole batch (the
   training worker's `_per_token_scale`).
Per-token log-probabilities are Megatron-Core's own: the GPT model's per-token cross entropy with the labels
(vocabulary-parallel at TP > 1), negated.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pai_cookbook import rl, rlhf
from pai_cookbook.core import checkpoint, worker
from pai_cookbook.core.model import build_model, torch_dtype
from pai_cookbook.core.tokenizer import MegatronView
from pai_cookbook.generate import GenerationConfig
from pai_cookbook.rlhf import GRPOJob
from pai_cookbook.workers import generate as engine_worker
from pai_cookbook.workers import train as trainer

_SEED_STRIDE = 1_000_003


def step_prompts(job: GRPOJob, step: int) -> list[int]:
    """The prompt indices of step `step`: passes over the prompt set, each pass in an order seeded by (seed, pass)."""
    return trainer.seeded_passes(len(job.prompt_ids), step, job.grpo.prompts_per_step, job.grpo.seed)


def sample(engine, job: GRPOJob, step: int, prompts: list[int], vocab_size: int) -> list[dict[str, Any]]:
    """`group_size` completions of each prompt from the engine: tokens (the end token included when one
    ended it) and the engine's log-probability of each sampled token before it."""
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    controller = engine.controller
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, num_tokens_to_generate=job.grpo.max_new_tokens,
                            return_log_probs=True)
    params.add_attributes({"no_early_termination": True})  # ends are the cookbook controller's rule
    rows = [(prompt, group) for group, prompt in enumerate(prompts) for _ in range(job.grpo.group_size)]
    ids = [job.prompt_ids[prompt] for prompt, _ in rows]
    controller.sampling_rng.manual_seed(job.grpo.seed * _SEED_STRIDE + step)
    controller.configure(vocab_size=vocab_size, repetition_penalty=1.0, eos_ids=job.eos_ids, stop=[],
                         prompt_lengths=[len(i) for i in ids], max_new_tokens=job.grpo.max_new_tokens,
                         track_entropy=True)
    first = min(len(i) for i in ids)  # the first sampling step's position: a row's token j is sampled at
    # step len(prompt) - first + j (rows with longer prompts feed their own tokens until then)
    requests = [InferenceRequest(request_id=engine.get_new_request_id(), prompt="", prompt_tokens=list(i),
                                 sampling_params=params) for i in ids]
    out = []
    for row, ((prompt, group), request) in enumerate(zip(rows, engine.generate(inference_requests=requests))):
        tokens = request.generated_tokens.tolist()
        logprobs = [float(x) for x in request.generated_log_probs]
        finish = controller.finish[row]
        if finish == engine_worker.FINISH_EOS:  # the end token ends the row uncounted; the policy must learn it
            end = int(controller.tokens[row, len(ids[row]) + len(tokens)])
            if end not in job.eos_ids:
                raise RuntimeError(f"row {row} finished on an end token, but {end} is not one of {job.eos_ids}: "
                                   f"prompt {len(ids[row])} tokens, generated {tokens}, buffer after the prompt "
                                   f"{controller.tokens[row, len(ids[row]):].tolist()}")
            tokens.append(end)
        steps = range(len(ids[row]) - first, len(ids[row]) - first + len(tokens))
        entropy = [float(controller.entropies[i][row]) for i in steps if i < len(controller.entropies)]
        out.append({"step": step, "row": row, "prompt": prompt, "group": group, "tokens": tokens,
                    "engine_logprobs": logprobs, "entropy": entropy, "finish": finish})
    return out


def _rewards(job: GRPOJob, rollouts: list[dict[str, Any]], hf_tokenizer) -> list[float]:
    """Each completion's reward, computed on global rank 0 and broadcast (the function runs once)."""
    values: list[Any] = [None]
    if worker.rank() == 0:
        function = rlhf.resolve_reward(job.reward)
        values = [[rlhf.score(function, hf_tokenizer.decode(r["tokens"], skip_special_tokens=True),
                              job.records[r["prompt"]]) for r in rollouts]]
    torch.distributed.broadcast_object_list(values, src=0)
    return values[0]


def rows(job: GRPOJob, rollouts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """[rows, longest prompt + max_new_tokens] training rows: prompt + completion, labels shifted by one,
    `loss_mask` on the positions that predict a completion token, the engine's log-probabilities there
    (`engine_mask`: without an appended end token, whose log-probability the engine does not return)."""
    n, width = len(rollouts), job.run.data.seq_length
    tokens = torch.full((n, width), job.pad_id, dtype=torch.long)
    labels = torch.full((n, width), job.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(n, width)
    engine = torch.zeros(n, width)
    engine_mask = torch.zeros(n, width)
    for row, rollout in enumerate(rollouts):
        prompt = job.prompt_ids[rollout["prompt"]]
        sequence = prompt + rollout["tokens"]
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        labels[row, :len(sequence) - 1] = torch.tensor(sequence[1:])
        loss_mask[row, len(prompt) - 1:len(sequence) - 1] = 1.0
        sampled = rollout.get("engine_logprobs") or []
        engine[row, len(prompt) - 1:len(prompt) - 1 + len(sampled)] = torch.tensor(sampled)
        engine_mask[row, len(prompt) - 1:len(prompt) - 1 + len(sampled)] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "engine_logprobs": engine,
            "engine_mask": engine_mask}


def micro_batches(job: GRPOJob, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's share of the batch, in micro-batches."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    per_rank = job.grpo.rows // dp_size
    mine = {k: v[dp_rank * per_rank:(dp_rank + 1) * per_rank] for k, v in batch.items()}
    size = job.grpo.micro_batch_size
    out = []
    for start in range(0, per_rank, size):
        mb = {k: v[start:start + size] for k, v in mine.items()}
        mb["loss_count"] = mb["loss_mask"].sum()
        out.append(mb)
    return out


def _logprob_forward(data_iterator, model):
    batch = next(data_iterator)
    return trainer.model_forward(model, batch), _keep_logprobs


def _keep_logprobs(output: torch.Tensor):
    return output.sum() * 0.0, {"logprobs": -output.detach().float()}


def logprobs(model: list[torch.nn.Module], job: GRPOJob, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Per-token log-probabilities of each micro-batch's labels, without gradients (on the last pipeline
    stage; an empty list on the others)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    modes = [chunk.training for chunk in model]  # the frozen reference stays in eval mode
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        stored = get_forward_backward_func()(
            forward_step_func=_logprob_forward, data_iterator=iter(batches), model=model[0],
            num_microbatches=len(batches), seq_length=job.run.data.seq_length,
            micro_batch_size=job.grpo.micro_batch_size, decoder_seq_length=job.run.data.seq_length, forward_only=True)
    for chunk, training in zip(model, modes):
        chunk.train(training)
    return [s["logprobs"].cpu() for s in stored]


def _grpo_forward(data_iterator, model):
    batch = next(data_iterator)
    return trainer.model_forward(model, batch), partial(_grpo_loss, batch)


def _grpo_loss(batch: dict[str, Any], output: torch.Tensor):
    """The clipped surrogate + kl_coef x KL of the micro-batch's completion tokens, summed and scaled to its
    share of the global per-token mean; the sums behind the logged figures."""
    logprobs = -output.float()
    mask = batch["loss_mask"].to(logprobs)
    surrogate, clipped = rl.clipped_surrogate(logprobs, batch["old_logprobs"].to(logprobs),
                                              batch["advantages"].to(logprobs)[:, None], batch["clip"])
    kl = rl.kl(logprobs, batch["ref_logprobs"].to(logprobs), batch["kl_estimator"])
    total = ((surrogate + batch["kl_coef"] * kl) * mask).sum()
    report = torch.stack([total, (surrogate * mask).sum(), (kl * mask).sum(), (clipped * mask).sum(), mask.sum()])
    return total * batch["loss_scale"], {"grpo": report.detach()}


def _max_over_world(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    tensor = tensor.cuda() if torch.cuda.is_available() else tensor
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


def update(job: GRPOJob, model, optimizer, scheduler, batches: list[dict[str, Any]]) -> list[dict[str, float]]:
    """`epochs` optimizer steps on the batch; per step the loss, its parts and the gradient norm."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = job.grpo
    scale = trainer._per_token_scale(batches)
    batches = [b | {"loss_scale": scale, "clip": g.clip, "kl_coef": g.kl_coef, "kl_estimator": g.kl_estimator}
               for b in batches]
    figures = []
    for _ in range(g.epochs):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        stored = get_forward_backward_func()(
            forward_step_func=_grpo_forward, data_iterator=iter(batches), model=model[0],
            num_microbatches=len(batches), seq_length=job.run.data.seq_length, micro_batch_size=g.micro_batch_size,
            decoder_seq_length=job.run.data.seq_length, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        total, surrogate, kl, clipped, count = trainer.global_sums(stored, "grpo", 5).tolist()
        count = max(count, 1.0)
        figures.append({"loss": total / count, "policy_loss": surrogate / count, "kl": kl / count,
                        "clip_fraction": clipped / count, "grad_norm": float(grad_norm or 0.0)})
    return figures


def grpo_step(job: GRPOJob, step: int, model, reference, optimizer, scheduler, engine, hf_tokenizer,
              replay: dict[int, list[dict[str, Any]]] | None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One GRPO step; returns its figures and its rollouts (with rewards)."""
    start = time.perf_counter()
    if replay is not None:
        if step not in replay:
            raise RuntimeError(f"the replayed rollouts file {job.grpo.rollouts} has no step {step}")
        rollouts = replay[step]
        rewards = [r["reward"] for r in rollouts]
    else:
        prompts = step_prompts(job, step)
        rollouts = sample(engine, job, step, prompts, job.run.model.vocab_size)
        rewards = _rewards(job, rollouts, hf_tokenizer)
    sampled = time.perf_counter()
    used = torch.tensor(rewards, dtype=torch.float64)
    if job.grpo.shuffle_rewards:  # the control: same rewards, assigned at random
        generator = torch.Generator().manual_seed(job.grpo.seed * _SEED_STRIDE + step + 1)
        used = used[torch.randperm(len(used), generator=generator)]
    advantages = rl.group_advantages(used, [r["group"] for r in rollouts]).float()
    batch = rows(job, rollouts) | {"advantages": advantages}
    batches = micro_batches(job, batch)
    old = logprobs(model, job, batches)
    ref = logprobs(reference, job, batches)
    difference = 0.0
    for mb, lp in zip(batches, old):  # last pipeline stage only: the others hold no log-probabilities
        mask = mb["engine_mask"] > 0
        if mask.any():
            difference = max(difference, float((lp[mask] - mb["engine_logprobs"][mask]).abs().max()))
    for i, mb in enumerate(batches):
        mb["old_logprobs"] = old[i] if old else torch.zeros_like(mb["loss_mask"])
        mb["ref_logprobs"] = ref[i] if ref else torch.zeros_like(mb["loss_mask"])
    updates = update(job, model, optimizer, scheduler, batches)
    lengths = [len(r["tokens"]) for r in rollouts]
    figures = updates[-1] | {
        "reward": float(sum(rewards) / len(rewards)),
        "reward_std": float(torch.tensor(rewards, dtype=torch.float64).std()),
        "kl_before_update": updates[0]["kl"],
        "logprob_diff": _max_over_world(difference) if replay is None else None,  # replayed: no engine ran
        "completion_length": sum(lengths) / len(lengths),
        # the policy's next-token entropy at each sampled token (nats), from the engine's logits
        "entropy": _mean([e for r in rollouts for e in r.get("entropy", [])]),
        "ended": sum(r["finish"] == engine_worker.FINISH_EOS for r in rollouts) / len(rollouts),
        "zero_advantage_groups": _flat_groups(rewards, [r["group"] for r in rollouts]),
        "rollout_seconds": sampled - start, "seconds": time.perf_counter() - start}
    for rollout, reward in zip(rollouts, rewards):
        rollout["reward"] = reward
    return figures, rollouts


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _flat_groups(rewards: list[float], groups: list[int]) -> float:
    """Share of groups whose completions all got the same reward: they teach nothing this step."""
    by_group: dict[int, set[float]] = {}
    for reward, group in zip(rewards, groups):
        by_group.setdefault(group, set()).add(reward)
    return sum(len(values) == 1 for values in by_group.values()) / len(by_group)


def _replay(path: str | None) -> dict[int, list[dict[str, Any]]] | None:
    if not path:
        return None
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(record["step"], {})[record["row"]] = record  # a resumed run's repeat: the last
    return {step: [rows_[i] for i in sorted(rows_)] for step, rows_ in by_step.items()}


def train(job: GRPOJob, device) -> dict[str, Any]:
    config = job.run
    model, optimizer, scheduler = trainer.build(config, device)
    first_step, started_from = trainer._restore(config, model, optimizer, scheduler)
    reference = build_model(config.model, config.parallel, config.precision, device, config.seed)
    checkpoint.load(reference, job.reference)
    for chunk in reference:
        chunk.eval()
        chunk.requires_grad_(False)
    hf_tokenizer = checkpoint.load_tokenizer(config.checkpoint.load_dir)
    dtype = torch_dtype(config.precision)
    engine = engine_worker.build_engine(
        model[0].module, config.model, MegatronView(hf_tokenizer, job.eos_ids),
        GenerationConfig(batch_size=job.grpo.rows, max_new_tokens=job.grpo.max_new_tokens),
        config.data.seq_length, config.parallel, dtype)
    replay = _replay(job.grpo.rollouts)
    log = trainer.StepLog(config, device, fresh=first_step == 0)
    run_dir = os.environ.get(worker.RUN_DIR_ENV)
    dump = (Path(run_dir) / "rollouts.jsonl").open("w" if first_step == 0 else "a") if run_dir and worker.rank() == 0 \
        else None
    ckpt, history, saved = config.checkpoint, [], None
    for step in range(first_step, job.grpo.steps):
        figures, rollouts = grpo_step(job, step, model, reference, optimizer, scheduler, engine, hf_tokenizer, replay)
        done = step + 1
        saved = trainer.save_if_due(config, model, optimizer, scheduler, done,
                                    Path(ckpt.load_dir) / checkpoint.HF_ASSETS) or saved
        history.append(figures)
        log.write(done, figures)
        if dump is not None:
            for rollout in rollouts:
                text = hf_tokenizer.decode(rollout["tokens"], skip_special_tokens=True)
                dump.write(json.dumps(rollout | {"text": text}) + "\n")
            dump.flush()
        if worker.rank() == 0:
            worker.progress(done, job.grpo.steps, reward=figures["reward"], kl=figures["kl"],
                            loss=figures["loss"])
    log.close()
    if dump is not None:
        dump.close()
    return {"first_step": first_step, "started_from": started_from, "steps": history,
            "checkpoint": str(saved) if saved else None, "world_size": torch.distributed.get_world_size(),
            "device": device.name}


@worker.entry(GRPOJob)
def main(job: GRPOJob) -> dict[str, Any]:
    with worker.session(job.run.parallel, job.run.seed) as device:
        return train(job, device)


if __name__ == "__main__":
    main()
