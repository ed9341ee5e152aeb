"""The RL worker: GRPO and PPO on Megatron-Core, rollouts from Megatron-Core's engine on the policy's own modules.

Its job is a `core.launching.jobs.RLJob` (PPO when its config is a PPOConfig). One step (`rl_step`):
1. `sample`: the static inference engine of notebook 07 (`workers.generate.build_engine`) over the very
   GPTModel the optimizer updates (DDP's `.module`), temperature 1, no top-k/top-p, seeded by (seed, step),
   its controller recording each sampled token's log-probability. Every rank samples every completion (same
   seeds, same tokens); each data-parallel rank then trains on its share.
2. Rewards: a function on global rank 0 (once per completion), broadcast; or a reward model's forward
   (its score at each completion's last token), each data-parallel rank scoring its share, gathered.
3. Forward passes without gradients through Megatron-Core's pipeline schedule: the policy's log-probabilities
   (the "old" ones of the ratio), the reference's and, for PPO, the critic's values. The engine's
   log-probabilities are compared with the policy's here: they are the same weights, so they must agree
   (KV-cached one-token steps against one full forward: float rounding only), and after an update a stale
   copy would not.
4. Advantages. GRPO: each completion's reward against its group's. PPO: per-token rewards (-kl_coef x KL to
   the reference, plus the score on the last token), GAE over the critic's values, whitened over the batch.
5. `epochs` optimizer steps on the clipped surrogate (+ kl_coef x KL for GRPO, whose KL is a loss), per token
   over the whole batch (`workers.training.per_token_scale`); PPO's critic takes a step on the clipped
   value loss after each. PPO's adaptive controller then moves kl_coef.
Per-token log-probabilities are Megatron-Core's own: the GPT model's per-token cross entropy with the labels
(vocabulary-parallel at TP > 1), negated.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.generation import GenerationConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import RLJob
from pai_cookbook.core.modeling.model import torch_dtype
from pai_cookbook.core.rl import reward_functions, rl_math
from pai_cookbook.core.rl.rl_math import AdaptiveKL, RLError
from pai_cookbook.core.text.tokenizer import MegatronView
from pai_cookbook.workers import engine as inference
from pai_cookbook.workers import run_state, training
from pai_cookbook.workers.models import build_model
from pai_cookbook.workers.rl_updates import (
    forward_only,
    logprobs,
    max_over_world,
    micro_batches,
    ppo_advantages,
    read_score,
    read_values,
    rows,
    update,
)

_SEED_STRIDE = 1_000_003


def step_prompts(job: RLJob, step: int) -> list[int]:
    """The prompt indices of step `step`: passes over the prompt set, each pass in an order seeded by (seed, pass)."""
    return run_state.seeded_passes(len(job.prompt_ids), step, job.config.prompts_per_step, job.config.seed)


def sample(engine, job: RLJob, prompt_ids: list[list[int]], prompts: list[int], group_size: int, seed: int,
           step: int) -> list[dict[str, Any]]:
    """`group_size` completions of each of `prompts` (indices into `prompt_ids`) from the engine, its sampling
    seeded by `seed`: tokens (the end token included when one ended it), the log-probability of each under
    the engine's logits (`workers.engine.token_logprobs`) and the entropy of the distribution it came from."""
    from megatron.core.inference.sampling_params import SamplingParams

    controller = engine.controller
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, num_tokens_to_generate=job.config.max_new_tokens)
    params.add_attributes({"no_early_termination": True})  # ends are the cookbook controller's rule
    rows = [(prompt, group) for group, prompt in enumerate(prompts) for _ in range(group_size)]
    ids = [prompt_ids[prompt] for prompt, _ in rows]
    controller.sampling_rng.manual_seed(seed)
    # On the CPU path, packed from the weights as they are now: the policy trains between two calls (cpu.linear).
    with inference.decoding_weights(engine, rows=len(ids)):
        done = inference.generate_batch(engine, ids, params, vocab_size=job.run.model.vocab_size,
                                            repetition_penalty=1.0, eos_ids=job.eos_ids, stop=[],
                                            max_new_tokens=job.config.max_new_tokens, track_logprobs=True)
    out = []
    for row, ((prompt, group), request) in enumerate(zip(rows, done)):
        tokens = request.generated_tokens.tolist()
        width = controller.prompt_lengths[row]  # the prompt, left-padded to the batch's longest where it is
        finish = controller.finish[row]
        if finish == inference.FINISH_EOS:  # the end token ends the row uncounted; the policy must learn it
            end = int(controller.tokens[row, width + len(tokens)])
            if end not in job.eos_ids:
                raise RuntimeError(f"row {row} finished on an end token, but {end} is not one of {job.eos_ids}: "
                                   f"prompt {len(ids[row])} tokens (padded to {width}), generated {tokens}, buffer "
                                   f"after the prompt {controller.tokens[row, width:].tolist()}")
            tokens.append(end)
        logprobs = [float(controller.logprobs[i][row]) for i in range(len(tokens))]
        entropy = [float(controller.entropies[i][row]) for i in range(len(tokens))]
        out.append({"step": step, "row": row, "prompt": prompt, "group": group, "tokens": tokens,
                    "engine_logprobs": logprobs, "entropy": entropy, "finish": finish})
    return out


def _function_scores(spec: str, rollouts: list[dict[str, Any]], records: list[dict[str, Any]],
                     hf_tokenizer) -> list[float]:
    """The function's score of each completion, computed on global rank 0 and broadcast (it runs once)."""
    values: list[Any] = [None]
    if worker.rank() == 0:
        function = reward_functions.resolve_reward(spec)
        try:
            values = [[reward_functions.score(function, hf_tokenizer.decode(r["tokens"], skip_special_tokens=True),
                                              records[r["prompt"]], f"the reward function {spec}") for r in rollouts]]
        except RLError as err:  # every rank learns of it (none waits on the broadcast), then they save and stop
            values = [str(err)]
    torch.distributed.broadcast_object_list(values, src=0)
    if isinstance(values[0], str):
        raise RLError(values[0])
    return values[0]


def rewards(job: RLJob, reward_model, rollouts: list[dict[str, Any]], prompt_ids: list[list[int]],
            records: list[dict[str, Any]], hf_tokenizer) -> list[float]:
    """Each completion's reward on every rank: the reward function's, or the reward model's score at the
    completion's last token (a truncated completion is scored where it stops)."""
    if reward_model is None:
        return _function_scores(job.reward, rollouts, records, hf_tokenizer)
    batches = micro_batches(job, rows(job, rollouts, prompt_ids))
    scores = forward_only(reward_model, job, batches, read_score)
    return training.gather_rows(torch.cat(scores).tolist() if scores else None)


def rl_step(job: RLJob, step: int, model, reference, optimizer, scheduler, engine, hf_tokenizer,
            replay: dict[int, list[dict[str, Any]]] | None, reward_model=None, critic=None,
            kl_coef: float = 0.0) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One GRPO or PPO step; returns its figures and its rollouts (with rewards). `critic`: PPO's (model,
    optimizer, scheduler); `kl_coef`: PPO's current coefficient of the KL in the reward."""
    start = time.perf_counter()
    g = job.config
    if replay is not None:
        if step not in replay:
            raise RuntimeError(f"the replayed rollouts file {g.rollouts} has no step {step}")
        rollouts = replay[step]
        scores = [r["reward"] for r in rollouts]
    else:
        prompts = step_prompts(job, step)
        rollouts = sample(engine, job, job.prompt_ids, prompts, g.group_size, g.seed * _SEED_STRIDE + step, step)
        scores = rewards(job, reward_model, rollouts, job.prompt_ids, job.records, hf_tokenizer)
    true = _function_scores(job.true_reward, rollouts, job.records, hf_tokenizer) if job.true_reward else None
    sampled = time.perf_counter()
    used = torch.tensor(scores, dtype=torch.float64)
    if g.shuffle_rewards:  # the control: same rewards, assigned at random
        generator = torch.Generator().manual_seed(g.seed * _SEED_STRIDE + step + 1)
        used = used[torch.randperm(len(used), generator=generator)]
    batch = rows(job, rollouts, job.prompt_ids) | {"score": used.float()}
    if job.ppo is None:
        batch["advantages"] = rl_math.group_advantages(used, [r["group"] for r in rollouts]).float()[:, None]
    batches = micro_batches(job, batch)
    old = logprobs(model, job, batches)
    ref = logprobs(reference, job, batches)
    values = forward_only(critic[0], job, batches, read_values) if critic is not None else []
    difference = 0.0
    for mb, lp in zip(batches, old):  # last pipeline stage only: the others hold no log-probabilities
        mask = mb["engine_mask"] > 0
        if mask.any():
            difference = max(difference, float((lp[mask] - mb["engine_logprobs"][mask]).abs().max()))
    for i, mb in enumerate(batches):
        zeros = torch.zeros_like(mb["loss_mask"])
        mb["old_logprobs"] = old[i] if old else zeros
        mb["ref_logprobs"] = ref[i] if ref else zeros
        if critic is not None:
            mb["old_values"] = values[i] if values else zeros
    extra = ppo_advantages(job, batches, kl_coef) | {"kl_coef": kl_coef} if critic is not None else {}
    updates = update(job, model, optimizer, scheduler, batches, critic)
    lengths = [len(r["tokens"]) for r in rollouts]
    figures = updates[-1] | extra | {
        "reward": float(sum(scores) / len(scores)),
        "reward_std": float(torch.tensor(scores, dtype=torch.float64).std()) if len(scores) > 1 else 0.0,
        "true_reward": sum(true) / len(true) if true else None,
        "kl_before_update": updates[0]["kl"],
        "logprob_diff": max_over_world(difference) if replay is None else None,  # replayed: no engine ran
        "completion_length": sum(lengths) / len(lengths),
        # the policy's next-token entropy at each sampled token (nats), from the engine's logits
        "entropy": _mean([e for r in rollouts for e in r.get("entropy", [])]),
        "ended": sum(r["finish"] == inference.FINISH_EOS for r in rollouts) / len(rollouts),
        "rollout_seconds": sampled - start, "seconds": time.perf_counter() - start}
    if job.ppo is None:
        figures["zero_advantage_groups"] = _flat_groups(scores, [r["group"] for r in rollouts])
    for rollout, reward in zip(rollouts, scores):
        rollout["reward"] = reward
    return figures, rollouts


def evaluate(job: RLJob, done: int, engine, reward_model, hf_tokenizer) -> dict[str, Any]:
    """The policy's held-out figures after `done` steps: `eval_samples` completions of every held-out prompt,
    sampled as in training with one seed for every evaluation, scored by the reward and the true reward."""
    g = job.config
    prompts = list(range(len(job.eval_ids)))
    rollouts = sample(engine, job, job.eval_ids, prompts, g.eval_samples, (g.seed + 1) * _SEED_STRIDE - 1, done)
    scores = rewards(job, reward_model, rollouts, job.eval_ids, job.eval_records, hf_tokenizer)
    true = _function_scores(job.true_reward, rollouts, job.eval_records, hf_tokenizer) if job.true_reward else None
    texts = [hf_tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in rollouts]
    return {"step": done, "reward": sum(scores) / len(scores), "true_reward": sum(true) / len(true) if true else None,
            "completion_length": sum(len(r["tokens"]) for r in rollouts) / len(rollouts),
            "completions": [{"prompt": r["prompt"], "text": text, "reward": score}
                            | ({"true_reward": true[i]} if true else {})
                            for i, (r, text, score) in enumerate(zip(rollouts, texts, scores))]}


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


def _frozen(run, model_config, ckpt: str, device, head: str = "lm") -> list[torch.nn.Module]:
    chunks = build_model(model_config, run.parallel, run.precision, device, run.seed, head=head)
    checkpoint.load(chunks, ckpt)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def _critic(job: RLJob, device, first_step: int):
    """PPO's critic (model, optimizer, scheduler), restored to the policy's step."""
    model, optimizer, scheduler = training.build(job.critic, device, head="reward")
    step, source = run_state.restore(job.critic, model, optimizer, scheduler)
    if step != first_step:
        raise RuntimeError(f"the policy resumes at step {first_step} but its critic ({source}) at step {step}; "
                           f"a run stopped between the two saves. Remove {job.critic.checkpoint.save_dir}'s and the "
                           f"policy's checkpoints after step {min(step, first_step)}, or start over (overwrite=True).")
    return model, optimizer, scheduler


def train(job: RLJob, device) -> dict[str, Any]:
    config, g = job.run, job.config
    model, optimizer, scheduler = training.build(config, device)
    first_step, started_from = run_state.restore(config, model, optimizer, scheduler)
    reference = _frozen(config, config.model, job.reference, device)
    reward_model = _frozen(config, job.reward_model_config, job.reward_model, device, head="reward") \
        if job.reward_model else None
    critic = _critic(job, device, first_step) if job.ppo is not None else None
    controller = AdaptiveKL(coef=g.kl_coef, target=g.kl_target or 1.0, horizon=g.kl_horizon) if job.ppo is not None else None
    if controller is not None and first_step and started_from:
        controller.coef = checkpoint.read_state(started_from).get("kl_coef", g.kl_coef)
    hf_tokenizer = checkpoint.load_tokenizer(config.checkpoint.load_dir)
    dtype = torch_dtype(config.precision)
    engine = inference.build_engine(
        model[0].module, config.model, MegatronView(hf_tokenizer, job.eos_ids),
        GenerationConfig(batch_size=max(g.rows, len(job.eval_ids) * g.eval_samples), max_new_tokens=g.max_new_tokens),
        config.data.seq_length, config.parallel, dtype, device)
    replay = _replay(g.rollouts)
    log = run_state.StepLog(config, device, fresh=first_step == 0)
    run_dir = os.environ.get(worker.RUN_DIR_ENV)
    files = {name: worker.open_log(Path(run_dir) / f"{name}.jsonl", first_step == 0)
             for name in ("rollouts", "evals")} if run_dir and worker.rank() == 0 else {}
    evals = []

    def held_out(done: int) -> None:
        if job.eval_ids:
            evals.append(evaluate(job, done, engine, reward_model, hf_tokenizer))
            if files:
                files["evals"].write(json.dumps(evals[-1]) + "\n")
                files["evals"].flush()

    if first_step == 0:
        held_out(0)
    ckpt, history, saved = config.checkpoint, [], None
    for step in range(first_step, g.steps):
        coef = controller.coef if controller is not None else 0.0
        broken = None
        try:
            figures, rollouts = rl_step(job, step, model, reference, optimizer, scheduler, engine, hf_tokenizer,
                                        replay, reward_model, critic, coef)
        except RLError as err:  # a reward failed on a sample: keep the steps finished so far, then stop
            kept = _save_before_stopping(job, step, model, optimizer, scheduler, critic, controller, saved)
            raise RLError(f"{err} {kept}") from err
        except inference.NonFiniteLogits as err:  # the last update broke the policy: its next rollouts cannot be drawn
            broken = err
        if broken is not None:  # said outside the except block: the log's tail is the one error
            log.close()
            run_state.stop_with(config, step + 1, f"step {step + 1}: sampling its rollouts, {broken}", started_from)
        done = step + 1
        run_state.stop_if_non_finite(config, log, done, figures, started_from)  # before anything of the step is saved
        if controller is not None and g.kl_target is not None:
            controller.update(figures["kl_sequence"], g.rows)
        saved = run_state.save_if_due(config, model, optimizer, scheduler, done,
                                    Path(ckpt.load_dir) / checkpoint.HF_ASSETS, **_saved_state(job, controller)) or saved
        if critic is not None:
            run_state.save_if_due(job.critic, *critic, done, Path(job.critic.checkpoint.load_dir) / checkpoint.HF_ASSETS)
        if done == g.steps or (g.eval_interval and done % g.eval_interval == 0):
            held_out(done)
        history.append(figures)
        log.write(done, figures)
        if files:
            for rollout in rollouts:
                text = hf_tokenizer.decode(rollout["tokens"], skip_special_tokens=True)
                files["rollouts"].write(json.dumps(rollout | {"text": text}) + "\n")
            files["rollouts"].flush()
        if worker.rank() == 0:
            worker.progress(done, g.steps, reward=figures["reward"], kl=figures["kl"], loss=figures["loss"])
    log.close()
    for file in files.values():
        file.close()
    if first_step == g.steps and started_from:  # a finished run asked again: its checkpoint (evals.jsonl has the rest)
        saved = Path(started_from)
    return {"first_step": first_step, "started_from": started_from, "steps": history, "evals": evals,
            "checkpoint": str(saved) if saved else None, "world_size": torch.distributed.get_world_size(),
            "device": device.name, "engine": inference.engine_record(engine)}


def _saved_state(job: RLJob, controller) -> dict[str, Any]:
    """What an RL checkpoint keeps beside its weights: the reward it was trained with (a resume with another is
    refused: `rlhf.run`) and PPO's KL coefficient."""
    return {"reward": job.reward} | ({"kl_coef": controller.coef} if controller is not None else {})


def _save_before_stopping(job: RLJob, done: int, model, optimizer, scheduler, critic, controller, saved) -> str:
    """Save the `done` steps finished before a failure (collective), unless the last checkpoint holds them; returns
    what to tell the user."""
    config = job.run
    ckpt = config.checkpoint
    if not ckpt.save_dir or done == 0:
        return "No step had finished; nothing was saved."
    if saved is None or Path(saved) != checkpoint.iteration_dir(ckpt.save_dir, done):
        saved = run_state.save_now(config, model, optimizer, scheduler, done, Path(ckpt.load_dir) / checkpoint.HF_ASSETS,
                                 **_saved_state(job, controller))
        if critic is not None:
            run_state.save_now(job.critic, *critic, done, Path(job.critic.checkpoint.load_dir) / checkpoint.HF_ASSETS)
    return f"The {done} steps finished are saved in {saved}; fix the reward and run the same call again to resume."


@worker.entry(RLJob)
def main(job: RLJob) -> dict[str, Any]:
    with worker.session(job.run.parallel, job.run.seed) as device:
        return train(job, device)


if __name__ == "__main__":
    main()
