"""Reinforcement learning from rewards on Megatron-Core: GRPO and PPO, with rollouts from Megatron-Core's own engine.

    config = rlhf.GRPOConfig(steps=40, prompts_per_step=4, group_size=8, max_new_tokens=12, lr=1e-5)
    result = rlhf.grpo("sft/iter_0000100", prompts, "pai_cookbook.rewards:exact_answer", config,
                       save_dir="grpo", run_dir="runs/grpo")
    result = rlhf.ppo("sft/iter_0000100", prompts, "rm/iter_0000300", rlhf.PPOConfig(kl_target=3.0),
                      eval_prompts=held_out, true_reward="pai_cookbook.rewards:positional_match")
    curves = rlhf.history("runs/grpo")          # reward, kl, clip fraction, lengths... per step
    held = rlhf.evals("runs/ppo")               # the held-out reward (and true reward) at each evaluation

One step: Megatron-Core's static inference engine (notebook 07's, KV cache) samples `group_size`
completions of each of `prompts_per_step` prompts on the policy's own weights: the engine runs the very
modules the optimizer updates, in the same process, so there is no copy to synchronise, and every step
checks it (the engine's log-probabilities of the sampled tokens against the trainer's forward of the same
tokens; a stale copy would differ after the first update). The reward (a function, or a reward model's
score) scores each completion. GRPO's advantage is the reward against its group's (`rl.group_advantages`),
with a KL penalty to the frozen reference in the loss; PPO's come from a critic (a scalar-head GPT trained
beside the policy) by GAE over per-token rewards that carry the KL penalty (`rl.gae`, `rl.AdaptiveKL`).
The policy then takes `epochs` clipped policy-gradient steps (`rl.clipped_surrogate`), averaged per token
over the whole batch, as the training worker averages SFT's loss; PPO's critic a clipped value step after each.

Sampling is at temperature 1 with neither top-k nor top-p: the completions are drawn from the policy
itself, so the importance ratios and the engine-vs-trainer check compare like with like. Reward functions
are `reward(completion: str, record: dict) -> float` named as "module:function" (they run in the workers;
`pai_cookbook.rewards` has the built-in ones); each is tried on every prompt before launch (an empty completion,
the prompt's own text, the record's answer), and one that fails on a sampled completion stops the run after it saves
the steps finished. A reward model is a checkpoint `reward_model.train` wrote, with the policy's tokenizer.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pai_cookbook.core import checkpoint, inputs, layout, runtime, tokenizer
from pai_cookbook.core.config import (
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
)
from pai_cookbook.core.inputs import prompt_text
from pai_cookbook.core.job import Job
from pai_cookbook.core.model_config import ModelConfig
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
    """Optimizer steps (`epochs` per RL step) of linear warmup from 0 to lr: Adam's first steps move every weight
    by about lr whatever the gradient's size, which a small policy may not survive at a learning rate it learns
    well at later."""
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
    save_interval: int | None = None
    """Checkpoint every this many steps (and at the last); 0: the last only; None: every quarter of the run
    (`saves_every`), so a run that dies (a killed kernel, a lost node) loses at most a quarter of its steps. (A
    reward that fails mid-run saves the finished steps whatever this is.)"""
    chat_template: str = "auto"
    """Prompts through the tokenizer's chat template: "auto" (when it has one), "always", "never"."""
    eval_interval: int = 0
    """With `eval_prompts`: sample and score them before the first step, every this many steps and after the
    last (0: before the first and after the last only)."""
    eval_samples: int = 2
    """Completions per held-out prompt at each evaluation (temperature 1, one fixed seed for every evaluation)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for knob in ("steps", "prompts_per_step", "max_new_tokens", "epochs", "micro_batch_size", "eval_samples"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"{name}.{knob}={getattr(self, knob)} must be at least 1.")
        self._check_group_size()
        if not 0.0 < self.clip < 1.0:
            raise ConfigError(f"{name}.clip={self.clip} must lie in (0, 1); 0.2 is usual.")
        if self.kl_coef < 0:
            raise ConfigError(f"{name}.kl_coef={self.kl_coef} must be >= 0 (0 switches the KL penalty off).")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"{name}.kl_estimator={self.kl_estimator!r}; use one of {KL_ESTIMATORS}.")
        for knob in ("warmup_steps", "eval_interval", "save_interval"):
            if (getattr(self, knob) or 0) < 0:
                raise ConfigError(f"{name}.{knob}={getattr(self, knob)} must be >= 0.")
        if not self.lr > 0:
            raise ConfigError(f"{name}.lr={self.lr} must be > 0.")

    @property
    def saves_every(self) -> int:
        """Steps between checkpoints: `save_interval`, or a quarter of the run when it is None."""
        return -(-self.steps // 4) if self.save_interval is None else self.save_interval

    def _check_group_size(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"GRPOConfig.group_size={self.group_size}: GRPO compares the completions of one prompt "
                              f"with each other, so it needs at least 2 (8-64 is usual).")

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.group_size


@dataclass(kw_only=True)
class PPOConfig(GRPOConfig):
    """The knobs of a PPO run (InstructGPT's recipe, Ziegler et al. 2019): a critic (a scalar-head GPT, by
    default the reward model's weights) predicts each token's return; GAE turns the per-token rewards into
    advantages; the KL to the reference is a per-token penalty in the reward, its coefficient fixed or steered
    by `rl.AdaptiveKL` towards `kl_target`. The fields it shares with GRPOConfig mean the same."""

    group_size: int = 1
    """Completions per prompt (the critic is PPO's baseline, so 1 is usual)."""
    kl_coef: float = 0.05
    """The KL penalty's (starting) coefficient in the reward: r_t = -kl_coef KL_t, plus the score at the end."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    kl_target: float | None = None
    """Per-completion KL (summed over its tokens) the adaptive controller steers to; None: a fixed kl_coef."""
    kl_horizon: int = 10_000
    """The controller's horizon in completions: how slowly the coefficient moves (Ziegler et al.: 10,000)."""
    critic_lr: float | None = None
    """The critic's learning rate (default: lr)."""
    value_clip: float = 0.2
    """How far a value may move from the rollout's before its clipped error counts (in reward units)."""
    gamma: float = 1.0
    lam: float = 0.95
    """GAE's discount and lambda (per token; 1 and 0.95 as in InstructGPT-style RLHF)."""
    whiten_advantages: bool = True
    """Normalise the advantages over each step's completion tokens (zero mean, unit variance)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_target is not None and not self.kl_target > 0:
            raise ConfigError(f"PPOConfig.kl_target={self.kl_target} must be > 0 (or None for a fixed coefficient).")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ConfigError("PPOConfig.kl_coef=0 with a kl_target: the adaptive controller scales the coefficient, "
                              "so it can never leave 0. Start it above 0 (0.05 is usual).")
        if self.kl_horizon < 1 or not self.value_clip > 0 or not 0 < self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"PPOConfig: kl_horizon={self.kl_horizon} must be >= 1, value_clip={self.value_clip} > 0, "
                              f"gamma={self.gamma} in (0, 1], lam={self.lam} in [0, 1].")
        if self.critic_lr is not None and not self.critic_lr > 0:
            raise ConfigError(f"PPOConfig.critic_lr={self.critic_lr} must be > 0.")

    def _check_group_size(self) -> None:
        if self.group_size < 1:
            raise ConfigError(f"PPOConfig.group_size={self.group_size} must be at least 1.")


@dataclass(kw_only=True)
class RLJob(Job):
    """The RL worker's job: the policy's training config, the reference, the prompts and the reward; for PPO
    the critic's training config."""

    WORKER: ClassVar[str] = "pai_cookbook.workers.rl"
    SPANS_NODES: ClassVar[bool] = True
    REPEATED_STEPS: ClassVar[bool] = True

    run: RunConfig
    """Model, layout, precision, optimizer, checkpoints (load_dir: the starting policy)."""
    grpo: GRPOConfig | None = None
    ppo: PPOConfig | None = None
    """One of the two: the algorithm and its knobs."""
    reference: str
    reward: str
    """The reward as given: "module:function", or a reward model's checkpoint (then `reward_model`)."""
    reward_model: str | None = None
    reward_model_config: ModelConfig | None = None
    critic: RunConfig | None = None
    """PPO: the critic's training config (load_dir: where it starts; save_dir: the policy's save_dir/critic)."""
    true_reward: str | None = None
    """A "module:function" logged beside the reward and never trained on (reward over-optimisation shows as
    the reward rising while this falls)."""
    records: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    eval_records: list[dict[str, Any]] = field(default_factory=list)
    eval_ids: list[list[int]] = field(default_factory=list)
    eos_ids: list[int]
    pad_id: int

    @property
    def config(self) -> GRPOConfig:
        return self.ppo or self.grpo

    def check(self, world_size: int, device: Any) -> None:
        self.run.validate(world_size, device)
        layout.check(self.run.model, self.run.parallel, world_size, purpose="infer")  # the engine's layout too
        if self.critic is not None:
            self.critic.validate(world_size, device)
        # the training rows are checked as the global batch; the held-out ones go through the same schedule
        whole = self.run.parallel.data_parallel_size(world_size) * self.config.micro_batch_size
        rows = len(self.eval_ids) * self.config.eval_samples
        if rows % whole:
            raise ConfigError(f"held-out prompts x eval_samples = {rows} completions do not split into whole "
                              f"micro-batches of {self.config.micro_batch_size} on every data-parallel rank; make "
                              f"it a multiple of {whole}.")


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


def score(reward: Reward, completion: str, record: dict[str, Any], what: str = "the reward function") -> float:
    """One reward, checked: a finite number, or an RLError naming the function, the prompt and the completion."""
    where = f"prompt {record.get('line', '?')} ({prompt_text(record)[:60]!r}), completion {completion[:60]!r}"
    try:
        value = reward(completion, record)
    except Exception as err:  # noqa: BLE001 -- a user's function; its error is reported with the prompt it failed on
        raise RLError(f"{what} raised {type(err).__name__}: {err} on {where}.") from err
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RLError(f"{what} returned {value!r} ({type(value).__name__}) on {where}; it must return a finite int "
                      f"or float.")
    return float(value)


def _records(prompts: Sequence[str | dict[str, Any]], what: str = "prompt") -> list[dict[str, Any]]:
    prompts = inputs.listed(prompts, f"{what}s", "strings or {'prompt': ...} records") if prompts is not None else []
    if not prompts:
        raise ConfigError(f"no {what}s: RL needs at least one (a string or {{'prompt': ...}}).")
    records = []
    for number, prompt in enumerate(prompts, start=1):
        record = {"line": number} | inputs.prompt_record(prompt, f"{what} {number}")
        if not prompt_text(record).strip():
            raise ConfigError(f"{what} {number} is empty; the policy would complete nothing. Remove it or fill it in.")
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
    _same_tokenizer(policy, reference, "reference")


def _reward_model(reward: str, policy: Path) -> Path | None:
    """The reward model's checkpoint when `reward` names one (a folder), else None (a "module:function")."""
    from pai_cookbook import generate

    if ":" in reward and not Path(reward).exists():
        return None
    if not Path(reward).is_dir():
        raise ConfigError(f"reward {reward!r} is neither a 'module:function' nor a reward model's checkpoint folder.")
    path = generate.resolve_checkpoint(reward, language_model=False)
    if checkpoint.head(path) != "reward":
        raise ConfigError(f"reward {reward!r} is a language model's checkpoint; give a reward model's (one that "
                          f"reward_model.train wrote) or a 'module:function'.")
    _same_tokenizer(policy, path, "reward model")
    return path


def _same_tokenizer(policy: Path, other: Path, what: str) -> None:
    if tokenizer.fingerprint(policy / checkpoint.HF_ASSETS) != tokenizer.fingerprint(other / checkpoint.HF_ASSETS):
        raise ConfigError(f"{what} {other} carries another tokenizer than the policy {policy}; token ids would "
                          f"not mean the same text. Use one trained from the policy's model or its base.")


def prepare(policy: str | Path, prompts: Sequence[str | dict[str, Any]], reward: str, config: GRPOConfig, *,
            reference: str | Path | None = None, critic: str | Path | None = None,
            eval_prompts: Sequence[str | dict[str, Any]] | None = None, true_reward: str | None = None,
            parallel: ParallelConfig | None = None, save_dir: str | Path | None = None,
            overwrite: bool = False) -> RLJob:
    """Check everything about a GRPO or PPO run (`config` decides) and tokenize its prompts; no worker starts."""
    from pai_cookbook import generate, train

    reward = str(reward)
    policy = generate.resolve_checkpoint(policy)
    reference = generate.resolve_checkpoint(reference) if reference else policy
    check_reference(policy, reference)
    model, dtype = checkpoint.read_config(policy)
    records = _records(prompts)
    eval_records = _records(eval_prompts, "held-out prompt") if eval_prompts is not None else []
    reward_model = _reward_model(reward, policy)
    functions = [(f"the reward function {spec}", resolve_reward(spec)) for spec in
                 ([reward] if reward_model is None else []) + [true_reward] if spec]
    for what, function in functions:  # tried on what a sampled completion may be: empty, text, the answer itself
        for record in records + eval_records:
            for completion in dict.fromkeys(["", prompt_text(record)[:200], str(record.get("answer", ""))]):
                score(function, completion, record, what)
    hf = checkpoint.load_tokenizer(policy)
    prompt_ids = [tokenizer.encode(hf, record, config.chat_template) for record in records]
    eval_ids = [tokenizer.encode(hf, record, config.chat_template) for record in eval_records]
    width = max(map(len, prompt_ids + eval_ids))
    reward_model_config = checkpoint.read_config(reward_model)[0] if reward_model else None
    limits = [model.max_position_embeddings] + ([reward_model_config.max_position_embeddings]
                                                if reward_model_config else [])
    if width + config.max_new_tokens > min(limits):
        longest = max(zip(records + eval_records, prompt_ids + eval_ids), key=lambda pair: len(pair[1]))[0]
        raise ConfigError(f"prompt {longest['line']} has {width} tokens; with max_new_tokens {config.max_new_tokens} "
                          f"it exceeds the {min(limits)} positions of the policy or the reward model. Shorten it or "
                          f"lower max_new_tokens.")
    eos = tokenizer.eos_ids(policy / checkpoint.HF_ASSETS, hf)
    if not eos:
        raise ConfigError(f"{policy}'s tokenizer names no end-of-sequence token; completions could never end.")
    if config.rollouts and not Path(config.rollouts).is_file():
        raise ConfigError(f"{type(config).__name__}.rollouts={config.rollouts!r} is not a file; give a rollouts.jsonl "
                          f"a run wrote.")
    parallel = parallel or ParallelConfig()
    layout.check(model, parallel, purpose="train")
    layout.check(model, parallel, purpose="infer")  # the engine samples at the training layout
    scalar_heads = [reward_model_config] if reward_model_config else []  # models with a scalar head
    data = DataConfig(seq_length=width + config.max_new_tokens, micro_batch_size=config.micro_batch_size,
                      global_batch_size=config.rows)
    steps = {"train_iters": config.steps, "seed": config.seed, "parallel": parallel, "data": data,
             "save_interval": config.saves_every, "overwrite": overwrite}
    run = train.continuing(policy, optimizer=_optimizer(config, config.lr), save_dir=save_dir, **steps)
    critic_run = None
    if isinstance(config, PPOConfig):
        start = generate.resolve_checkpoint(critic, language_model=False) if critic else reward_model or policy
        _same_tokenizer(policy, start, "critic")
        critic_run = train.continuing(start, optimizer=_optimizer(config, config.critic_lr or config.lr),
                                      save_dir=Path(save_dir) / CRITIC if save_dir else None, **steps)
        scalar_heads.append(critic_run.model)
    elif critic:
        raise ConfigError("a critic is PPO's (GRPO's baseline is the group mean); pass a PPOConfig, or drop critic.")
    if parallel.sequence_parallel and scalar_heads:
        raise ConfigError("sequence_parallel=True: a reward model's or critic's scalar head reads whole hidden states on "
                          "every tensor-parallel rank; run it without sequence parallelism.")
    for scalar_model in scalar_heads:
        layout.check(scalar_model, parallel, purpose="train")
    algorithm = {"ppo": config} if isinstance(config, PPOConfig) else {"grpo": config}
    return RLJob(run=run, **algorithm, reference=str(reference.resolve()), reward=reward,
                 reward_model=str(reward_model.resolve()) if reward_model else None,
                 reward_model_config=reward_model_config,
                 critic=critic_run, true_reward=true_reward, records=records, prompt_ids=prompt_ids,
                 eval_records=eval_records, eval_ids=eval_ids, eos_ids=eos, pad_id=eos[0])


CRITIC = "critic"
"""A PPO run's save_dir/critic holds the critic's checkpoints, step for step with the policy's."""


def _optimizer(config: GRPOConfig, lr: float) -> OptimizerConfig:
    return OptimizerConfig(lr=lr, min_lr=lr, lr_decay_style="constant", weight_decay=0.0,
                           lr_warmup_iters=config.warmup_steps, clip_grad=config.clip_grad)


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
    from pai_cookbook.core import launch

    job = prepare(policy, prompts, reward, config, reference=reference, critic=critic, eval_prompts=eval_prompts,
                  true_reward=true_reward, parallel=parallel, save_dir=save_dir, overwrite=overwrite)
    world = runtime.detect_launch_env().world_size(nproc_per_node)
    job.check(world, runtime.detect_device())
    with train.writing([job.run], run_dir):
        _pair_critic(job)
        train.preflight(job.run, world)
        _check_resumed_reward(job)
        return launch.launch(job, nproc_per_node=nproc_per_node, run_dir=run_dir, **launch_kwargs)


def _pair_critic(job: RLJob) -> None:
    """PPO resumes its policy and its critic from one step: a damaged latest checkpoint of either is set aside, then
    any step that only one of the two holds (a run stopped between the two saves) is set aside too, said once each."""
    ckpt = job.run.checkpoint
    if job.critic is None or not ckpt.save_dir or not ckpt.resume:
        return
    folders = [Path(ckpt.save_dir), Path(job.critic.checkpoint.save_dir)]
    said = [line for folder in folders for line in checkpoint.set_damaged_aside(folder)]
    steps = [{int(p.name[len(checkpoint.ITER_PREFIX):]) for p in checkpoint.finished_iterations(f)} for f in folders]
    both = max(steps[0] & steps[1], default=0)
    for folder, held in zip(folders, steps):
        for step in sorted(s for s in held if s > both):
            aside = checkpoint.set_aside(checkpoint.iteration_dir(folder, step), ".unpaired")
            said.append(f"{folder.name}/{aside.name}: step {step} has no partner in the other model's folder")
    for line in said:
        print(f"ppo: {line}; policy and critic resume from step {both}.")


def _check_resumed_reward(job: RLJob) -> None:
    """A resume keeps the reward it was trained with: another one is another run (a finished run asked again with
    another reward would otherwise return at once, with the old checkpoint)."""
    ckpt = job.run.checkpoint
    latest = checkpoint.finished_iterations(ckpt.save_dir)[-1:] if ckpt.save_dir and ckpt.resume else []
    saved = checkpoint.read_state(latest[0]).get("reward") if latest else None
    if saved is not None and saved != job.reward:
        raise ConfigError(f"cannot resume {latest[0]}: it was trained with the reward {saved!r}, this run asks "
                          f"{job.reward!r}. A resume continues the same run; give another save_dir (the new run can "
                          f"start from {latest[0]} as its policy), or overwrite=True to replace this one.")


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
