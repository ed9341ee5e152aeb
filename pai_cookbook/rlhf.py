"""Reinforcement learning from rewards on Megatron-Core: GRPO, with rollouts from Megatron-Core's own engine.

    config = rlhf.GRPOConfig(steps=40, prompts_per_step=4, group_size=8, max_new_tokens=12, lr=1e-5)
    result = rlhf.grpo("sft/iter_0000100", prompts, "pai_cookbook.rewards:exact_answer", config,
                       save_dir="grpo", run_dir="runs/grpo")
    curves = rlhf.history("runs/grpo")          # reward, kl, clip fraction, lengths... per step

One step: Megatron-Core's static inference engine (notebook 07's, KV cache) samples `group_size`
completions of each of `prompts_per_step` prompts on the policy's own weights: the engine runs the very
modules the optimizer updates, in the same process, so there is no copy to synchronise, and every step
checks it (the engine's log-probabilities of the sampled tokens against the trainer's forward of the same
tokens; a stale copy would differ after the first update). The reward function scores each completion;
GRPO's advantage is the reward against its group's (`rl.group_advantages`); the policy then takes
`epochs` clipped policy-gradient steps with a KL penalty to the frozen reference (`rl.clipped_surrogate`,
`rl.kl`), averaged per token over the whole batch, as the training worker averages SFT's loss.

Sampling is at temperature 1 with neither top-k nor top-p: the completions are drawn from the policy
itself, so the importance ratios and the engine-vs-trainer check compare like with like. Rewards are
functions `reward(completion: str, record: dict) -> float` named as "module:function" (they run in the
workers; `pai_cookbook.rewards` has the built-in ones); each is tried on every prompt before launch.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pai_cookbook.core import checkpoint, layout, runtime, tokenizer
from pai_cookbook.core.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
)
from pai_cookbook.core.worker import Job
from pai_cookbook.rl import KL_ESTIMATORS, RLError

Reward = Callable[[str, dict[str, Any]], float]


@dataclass(kw_only=True)
class GRPOConfig:
    """The knobs of a GRPO run. Defaults: DeepSeekMath's clip and KL coefficient, one update per batch."""

    steps: int = 20
    """Rollout-and-update steps."""
    prompts_per_step: int = 4
    """Prompts sampled per step (drawn in order from the prompt set, reshuffled every pass)."""
    group_size: int = 8
    """Completions per prompt; GRPO's baseline is their mean reward (at least 2)."""
    max_new_tokens: int = 16
    """Completion length limit, end-of-turn token included."""
    epochs: int = 1
    """Optimizer steps on each batch of rollouts (the first sees ratio 1; later ones are clipped)."""
    clip: float = 0.2
    """PPO's ratio clip: ratios outside [1 - clip, 1 + clip] stop the gradient where they would gain."""
    kl_coef: float = 0.04
    """Weight of the per-token KL(policy || reference) in the loss; 0 switches the reference off."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    lr: float = 1e-5
    """Adam's learning rate, constant after the warmup."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr: Adam's first steps move every weight by about lr whatever the
    gradient's size, which a small policy may not survive at a learning rate it learns well at later."""
    clip_grad: float = 1.0
    micro_batch_size: int = 8
    """Completions per forward/backward; a step's batch (prompts x group) is split into these."""
    seed: int = 1234
    """Sampling and prompt order; the same seed gives the same run at every layout."""
    shuffle_rewards: bool = False
    """The control: each step's rewards are permuted across its completions before the advantages, which
    keeps their distribution and removes their meaning. A run that learns anyway learned from noise."""
    rollouts: str | None = None
    """A rollouts.jsonl of an earlier run to replay instead of sampling (layout parity, debugging)."""
    save_interval: int = 0
    """Checkpoint every this many steps (and at the last); 0: the last only."""
    chat_template: str = "auto"
    """Prompts through the tokenizer's chat template: "auto" (when it has one), "always", "never"."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "max_new_tokens", "epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GRPOConfig.{name}={getattr(self, name)} must be at least 1.")
        if self.group_size < 2:
            raise ConfigError(f"GRPOConfig.group_size={self.group_size}: GRPO compares the completions of one prompt "
                              f"with each other, so it needs at least 2 (8-64 is usual).")
        if not 0.0 < self.clip < 1.0:
            raise ConfigError(f"GRPOConfig.clip={self.clip} must lie in (0, 1); 0.2 is usual.")
        if self.kl_coef < 0:
            raise ConfigError(f"GRPOConfig.kl_coef={self.kl_coef} must be >= 0 (0 switches the KL penalty off).")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"GRPOConfig.kl_estimator={self.kl_estimator!r}; use one of {KL_ESTIMATORS}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"GRPOConfig.warmup_steps={self.warmup_steps} must be >= 0.")
        if not self.lr > 0:
            raise ConfigError(f"GRPOConfig.lr={self.lr} must be > 0.")

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(kw_only=True)
class GRPOJob(Job):
    """The RL worker's job: the policy's training config, the reference, the prompts and the reward."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.rl"
    SPANS_NODES: ClassVar[bool] = True

    run: RunConfig
    """Model, layout, precision, optimizer, checkpoints (load_dir: the starting policy)."""
    grpo: GRPOConfig
    reference: str
    reward: str
    records: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    eos_ids: list[int]
    pad_id: int

    def check(self, world_size: int, device: Any) -> None:
        self.run.validate(world_size, device)
        layout.check(self.run.model, self.run.parallel, world_size, purpose="infer")  # the engine's layout too


def resolve_reward(spec: str) -> Reward:
    """The function a "module:function" string names (it must be importable in the workers too)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"reward {spec!r}: name it as 'module:function', e.g. 'pai_cookbook.rewards:exact_answer'; "
                          f"the workers import it, so a function defined in a notebook cell must move to a .py file.")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward {spec!r} cannot be imported ({err}); is {module} on the Python path?") from err
    if not callable(function):
        raise ConfigError(f"reward {spec!r} is a {type(function).__name__}, not a function.")
    return function


def score(reward: Reward, completion: str, record: dict[str, Any]) -> float:
    """One reward, checked: a finite number, or an RLError naming the prompt and the completion."""
    where = f"prompt {record.get('line', '?')} ({prompt_text(record)[:60]!r}), completion {completion[:60]!r}"
    try:
        value = reward(completion, record)
    except Exception as err:  # noqa: BLE001 -- a user's function; its error is reported with the prompt it failed on
        raise RLError(f"the reward function raised {type(err).__name__}: {err} on {where}.") from err
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RLError(f"the reward function returned {value!r} ({type(value).__name__}) on {where}; it must return "
                      f"a finite int or float.")
    return float(value)


def prompt_text(record: dict[str, Any]) -> str:
    """A prompt record's text: its "prompt", or its last message (what errors quote)."""
    return record["prompt"] if "prompt" in record else record["messages"][-1]["content"]


def _records(prompts: Sequence[str | dict[str, Any]]) -> list[dict[str, Any]]:
    if not prompts:
        raise ConfigError("no prompts: GRPO needs at least one prompt (a string or {'prompt': ...}).")
    records = []
    for number, prompt in enumerate(prompts, start=1):
        record = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        record.setdefault("line", number)
        if "prompt" not in record and "messages" not in record:
            raise ConfigError(f"prompt {number} has neither 'prompt' nor 'messages': {str(prompt)[:80]!r}.")
        if not prompt_text(record).strip():
            raise ConfigError(f"prompt {number} is empty; the policy would complete nothing. Remove it or fill it in.")
        records.append(record)
    return records


def check_reference(policy: Path, reference: Path) -> None:
    """The reference must be the same model (architecture and tokenizer) as the policy, or the KL is of
    two different vocabularies' distributions."""
    mine, _ = checkpoint.read_config(policy)
    theirs, _ = checkpoint.read_config(reference)
    differ = [name for name in vars(mine) if getattr(mine, name) != getattr(theirs, name)]
    if differ:
        raise ConfigError(f"reference {reference} is another model than the policy {policy}: they differ in {differ}. "
                          f"Use the checkpoint the policy started from (the default).")
    if tokenizer.fingerprint(policy / checkpoint.HF_ASSETS) != tokenizer.fingerprint(reference / checkpoint.HF_ASSETS):
        raise ConfigError(f"reference {reference} carries another tokenizer than the policy {policy}; token ids would "
                          f"not mean the same text. Use the checkpoint the policy started from.")


def prepare(policy: str | Path, prompts: Sequence[str | dict[str, Any]], reward: str, config: GRPOConfig, *,
            reference: str | Path | None = None, parallel: ParallelConfig | None = None,
            save_dir: str | Path | None = None, overwrite: bool = False) -> GRPOJob:
    """Check everything about a GRPO run and tokenize its prompts; no worker starts."""
    from pai_cookbook import generate

    policy = generate.resolve_checkpoint(policy)
    reference = generate.resolve_checkpoint(reference) if reference else policy
    check_reference(policy, reference)
    model, dtype = checkpoint.read_config(policy)
    records = _records(prompts)
    function = resolve_reward(reward)
    for record in records:  # a function that fails on an empty completion fails on the first bad sample too
        score(function, "", record)
    hf = checkpoint.load_tokenizer(policy)
    prompt_ids = [tokenizer.encode(hf, record, config.chat_template) for record in records]
    width = max(map(len, prompt_ids))
    if width + config.max_new_tokens > model.max_position_embeddings:
        longest = max(range(len(records)), key=lambda i: len(prompt_ids[i]))
        raise ConfigError(f"prompt {records[longest]['line']} has {width} tokens; with max_new_tokens "
                          f"{config.max_new_tokens} it exceeds the model's {model.max_position_embeddings} positions. "
                          f"Shorten it or lower max_new_tokens.")
    eos = tokenizer.eos_ids(policy / checkpoint.HF_ASSETS, hf)
    if not eos:
        raise ConfigError(f"{policy}'s tokenizer names no end-of-sequence token; completions could never end.")
    if config.rollouts and not Path(config.rollouts).is_file():
        raise ConfigError(f"GRPOConfig.rollouts={config.rollouts!r} is not a file; give a rollouts.jsonl a run wrote.")
    parallel = parallel or ParallelConfig()
    layout.check(model, parallel, purpose="train")
    layout.check(model, parallel, purpose="infer")  # the engine samples at the training layout
    run = RunConfig(
        model=model, parallel=parallel, precision=PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype]),
        optimizer=OptimizerConfig(lr=config.lr, min_lr=config.lr, lr_decay_style="constant", weight_decay=0.0,
                                  lr_warmup_iters=config.warmup_steps, clip_grad=config.clip_grad),
        data=DataConfig(seq_length=width + config.max_new_tokens, micro_batch_size=config.micro_batch_size,
                        global_batch_size=config.rows),
        checkpoint=CheckpointConfig(load_dir=str(policy), save_dir=str(save_dir) if save_dir else None,
                                    save_interval=config.save_interval, overwrite=overwrite, resume=not overwrite),
        train_iters=config.steps, seed=config.seed)
    return GRPOJob(run=run, grpo=config, reference=str(reference.resolve()), reward=reward, records=records,
                   prompt_ids=prompt_ids, eos_ids=eos, pad_id=eos[0])


def grpo(policy: str | Path, prompts: Sequence[str | dict[str, Any]], reward: str, config: GRPOConfig | None = None,
         *, reference: str | Path | None = None, parallel: ParallelConfig | None = None, nproc_per_node: int = 1,
         save_dir: str | Path | None = None, overwrite: bool = False, run_dir: str | Path = "runs/grpo",
         **launch_kwargs: Any) -> dict[str, Any]:
    """Train `policy` (a cookbook checkpoint) with GRPO under torchrun; returns rank 0's result.

    Args:
        prompts: strings or records {"prompt" or "messages", and whatever the reward function reads,
            e.g. "answer"}.
        reward: "module:function", `reward(completion, record) -> float`.
        reference: the frozen model of the KL penalty; default the policy's starting checkpoint.
        save_dir: checkpoints (a re-run resumes from its latest; `overwrite=True` starts it over).
    Returns:
        {"steps": per-step figures (reward, kl, clip_fraction, loss, logprob_diff, ...), "checkpoint"}.
        run_dir/metrics.jsonl has the same per step, run_dir/rollouts.jsonl every completion and reward.
    """
    from pai_cookbook import train
    from pai_cookbook.core import launch

    job = prepare(policy, prompts, reward, config or GRPOConfig(), reference=reference, parallel=parallel,
                  save_dir=save_dir, overwrite=overwrite)
    world = runtime.detect_launch_env().world_size(nproc_per_node)
    job.check(world, runtime.detect_device())
    train.preflight(job.run, world)
    return launch.launch(job, nproc_per_node=nproc_per_node, run_dir=run_dir, **launch_kwargs)


def history(run_dir: str | Path) -> dict[str, list[Any]]:
    """Every step a GRPO run logged (run_dir/metrics.jsonl, across resumed launches): figure -> values."""
    from pai_cookbook import train

    records = train.logged_steps(run_dir)
    return {key: [r.get(key) for r in records] for key in (records[0] if records else {})}


def read_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    """The completions a run sampled, one record per completion: step, prompt index, group, tokens, reward."""
    path = Path(run_dir) / "rollouts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
