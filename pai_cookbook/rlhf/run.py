"""Running GRPO and PPO from a notebook (`grpo`, `ppo`: check, lock, resume or start, launch) and reading a run back
(`history`, `evals`, `read_rollouts`, `sampled_reward`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint, damage
from pai_cookbook.core.configs.config import (
    ConfigError,
    ParallelConfig,
)
from pai_cookbook.core.configs.rlhf_config import GRPOConfig, PPOConfig
from pai_cookbook.core.launching import inputs
from pai_cookbook.core.launching.jobs import RLJob
from pai_cookbook.core.rl.reward_functions import resolve_reward, score
from pai_cookbook.rlhf.prepare import prepare


def grpo(policy: str | Path, prompts: Sequence[str | dict[str, Any]], reward: str, config: GRPOConfig | None = None,
         *, reference: str | Path | None = None, eval_prompts: Sequence[str | dict[str, Any]] | None = None,
         true_reward: str | None = None, parallel: ParallelConfig | None = None, nproc_per_node: int = 1,
         save_dir: str | Path | None = None, overwrite: bool = False, run_dir: str | Path = "runs/grpo",
         **launch_kwargs: Any) -> dict[str, Any]:
    """Train `policy` (a cookbook checkpoint) with GRPO under torchrun; returns rank 0's result.

    Args:
        prompts: strings or records {"prompt" or "messages", and whatever the reward function reads,
            e.g. "answer"}.
        reward: "module:function", `reward(completion, record) -> float`; or a reward model's checkpoint
            (reward_model.train's), which scores each completion at its last token.
        reference: the frozen model of the KL penalty; default the policy's starting checkpoint.
        eval_prompts, true_reward: held-out prompts sampled and scored at the start, every
            config.eval_interval steps and at the end; a "module:function" logged beside the reward there
            and on every step's completions, never trained on.
        save_dir: checkpoints (a re-run resumes from its latest; `overwrite=True` starts it over).
    Returns:
        {"steps": per-step figures (reward, kl, clip_fraction, loss, logprob_diff, ...), "evals": the held-out
        figures (step, reward, true_reward, completion_length), "checkpoint"}. run_dir/metrics.jsonl has the
        same per step, run_dir/rollouts.jsonl every completion and reward, run_dir/evals.jsonl every evaluation.
    """
    return _run(policy, prompts, reward, config or GRPOConfig(), reference=reference, eval_prompts=eval_prompts,
                true_reward=true_reward, parallel=parallel, nproc_per_node=nproc_per_node, save_dir=save_dir,
                overwrite=overwrite, run_dir=run_dir, **launch_kwargs)


def ppo(policy: str | Path, prompts: Sequence[str | dict[str, Any]], reward: str, config: PPOConfig | None = None,
        *, critic: str | Path | None = None, reference: str | Path | None = None,
        eval_prompts: Sequence[str | dict[str, Any]] | None = None, true_reward: str | None = None,
        parallel: ParallelConfig | None = None, nproc_per_node: int = 1, save_dir: str | Path | None = None,
        overwrite: bool = False, run_dir: str | Path = "runs/ppo", **launch_kwargs: Any) -> dict[str, Any]:
    """Train `policy` with PPO under torchrun: `grpo`'s arguments, and the critic's start (a reward model's or a
    language model's checkpoint, whose output layer then makes way for a fresh scalar head; default: the
    reward model when `reward` is one, else the policy). The per-step figures add the critic's: value_loss,
    value_clip_fraction, explained_variance, and kl_coef, kl_sequence (what the adaptive controller steers)."""
    return _run(policy, prompts, reward, config or PPOConfig(), critic=critic, reference=reference,
                eval_prompts=eval_prompts, true_reward=true_reward, parallel=parallel, nproc_per_node=nproc_per_node,
                save_dir=save_dir, overwrite=overwrite, run_dir=run_dir, **launch_kwargs)


def _run(policy, prompts, reward, config: GRPOConfig, *, nproc_per_node: int, run_dir, critic=None, reference=None,
         eval_prompts=None, true_reward=None, parallel=None, save_dir=None, overwrite=False, **launch_kwargs):
    from pai_cookbook import train

    job = prepare(policy, prompts, reward, config, reference=reference, critic=critic, eval_prompts=eval_prompts,
                  true_reward=true_reward, parallel=parallel, save_dir=save_dir, overwrite=overwrite)
    return train.launch_training(job, [job.run], job.check, nproc_per_node=nproc_per_node, run_dir=run_dir,
                                 before=lambda: pair_critic(job), after=lambda: _check_resumed_reward(job),
                                 **launch_kwargs)


def pair_critic(job: RLJob) -> None:
    """PPO resumes its policy and its critic from one step: a damaged latest checkpoint of either is set aside, then
    any step that only one of the two holds (a run stopped between the two saves) is set aside too, said once each."""
    ckpt = job.run.checkpoint
    if job.critic is None or not ckpt.save_dir or not ckpt.resume:
        return
    folders = [Path(ckpt.save_dir), Path(job.critic.checkpoint.save_dir)]
    said = [line for folder in folders for line in damage.set_damaged_aside(folder)]
    steps = [{int(p.name[len(checkpoint.ITER_PREFIX):]) for p in checkpoint.finished_iterations(f)} for f in folders]
    both = max(steps[0] & steps[1], default=0)
    for folder, held in zip(folders, steps):
        for step in sorted(s for s in held if s > both):
            aside = damage.set_aside(checkpoint.iteration_dir(folder, step), ".unpaired")
            said.append(f"{folder.name}/{aside.name}: step {step} has no partner in the other model's folder")
    for line in said:
        print(f"ppo: {line}; policy and critic resume from step {both}.")


def _check_resumed_reward(job: RLJob) -> None:
    """A resume keeps the reward it was trained with: another one is another run (a finished run asked again with
    another reward would otherwise return at once, with the old checkpoint)."""
    latest = checkpoint.resume_point(job.run.checkpoint)
    saved = checkpoint.read_state(latest).get("reward") if latest is not None else None
    if saved is not None and saved != job.reward:
        raise ConfigError(f"cannot resume {latest}: it was trained with the reward {saved!r}, this run asks "
                          f"{job.reward!r}. A resume continues the same run; give another save_dir (the new run can "
                          f"start from {latest} as its policy), or overwrite=True to replace this one.")


def history(run_dir: str | Path) -> dict[str, list[Any]]:
    """Every step a GRPO or PPO run logged (run_dir/metrics.jsonl, across resumed launches): figure -> values."""
    from pai_cookbook import train

    records = train.logged_steps(run_dir)
    return {key: [r.get(key) for r in records] for key in (records[0] if records else {})}


def evals(run_dir: str | Path) -> dict[str, list[Any]]:
    """Every held-out evaluation of a run (run_dir/evals.jsonl, across resumed launches): figure -> values
    ("step", "reward", "true_reward", "completion_length", and "completions": each one's prompt, text, rewards)."""
    path = Path(run_dir) / "evals.jsonl"
    by_step = {r["step"]: r for r in (inputs.read_jsonl(path) if path.exists() else [])}  # a repeat: the last
    records = [by_step[step] for step in sorted(by_step)]
    return {key: [r.get(key) for r in records] for key in (records[0] if records else {})}


def read_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    """The completions a run sampled, one record per completion: step, prompt index, group, tokens, reward."""
    path = Path(run_dir) / "rollouts.jsonl"
    return inputs.read_jsonl(path)


def sampled_reward(ckpt: str | Path, prompts: Sequence[dict[str, Any]], reward: str, *, samples: int = 2,
                   max_new_tokens: int = 16, seed: int = 99, run_dir: str | Path = "runs/sampled_reward",
                   **generate_kwargs: Any) -> dict[str, Any]:
    """A checkpoint's mean reward on `prompts` as GRPO samples them (temperature 1, neither top-k nor top-p),
    `samples` completions per prompt with a fixed seed: the held-out figure that says whether RL helped.

    Returns:
        {"reward": the mean, "records": each completion with its prompt's fields and "reward"}.
    """
    from pai_cookbook import generate

    function = resolve_reward(reward)
    config = generate.GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_k=0, top_p=0.0,
                                       repetition_penalty=1.0, batch_size=len(prompts) * samples, seed=seed)
    asked = [dict(p) for p in prompts for _ in range(samples)]
    records = generate.generate(ckpt, asked, config, run_dir=run_dir, **generate_kwargs)["records"]
    for record in records:
        record["reward"] = score(function, record["completion"], record)
    return {"reward": sum(r["reward"] for r in records) / len(records), "records": records}
