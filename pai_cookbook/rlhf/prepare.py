"""Everything about a GRPO or PPO run checked before launch, and its prompts tokenized: rewards tried on what a sampled
completion may be, the reference and critic against the policy, the prompts against the context."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import (
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
)
from pai_cookbook.core.configs.rlhf_config import GRPOConfig, PPOConfig
from pai_cookbook.core.launching import inputs
from pai_cookbook.core.launching.inputs import prompt_text
from pai_cookbook.core.launching.jobs import RLJob
from pai_cookbook.core.rl.reward_functions import resolve_reward, score
from pai_cookbook.core.text import tokenizer


def records_of(prompts: Sequence[str | dict[str, Any]], what: str = "prompt") -> list[dict[str, Any]]:
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
    policy, reference = checkpoint.resolve(policy), checkpoint.resolve(reference)
    mine, _ = checkpoint.read_config(policy)
    theirs, _ = checkpoint.read_config(reference)
    differ = [name for name in vars(mine) if getattr(mine, name) != getattr(theirs, name)]
    if differ:
        raise ConfigError(f"reference {reference} is another model than the policy {policy}: they differ in {differ}. "
                          f"Use the checkpoint the policy started from (the default).")
    same_tokenizer(policy, reference, "reference")


def reward_model_of(reward: str, policy: Path) -> Path | None:
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
    same_tokenizer(policy, path, "reward model")
    return path


def same_tokenizer(policy: Path, other: Path, what: str) -> None:
    if tokenizer.fingerprint(policy / checkpoint.HF_ASSETS) != tokenizer.fingerprint(other / checkpoint.HF_ASSETS):
        raise ConfigError(f"{what} {other} carries another tokenizer than the policy {policy}; token ids would "
                          f"not mean the same text. Use one trained from the policy's model or its base.")


def prepare(policy: str | Path, prompts: Sequence[str | dict[str, Any]], reward: str, config: GRPOConfig, *,
            reference: str | Path | None = None, critic: str | Path | None = None,
            eval_prompts: Sequence[str | dict[str, Any]] | None = None, true_reward: str | None = None,
            parallel: ParallelConfig | None = None, save_dir: str | Path | None = None,
            overwrite: bool = False) -> RLJob:
    """Check everything about a GRPO or PPO run (`config` decides) and tokenize its prompts; no worker starts."""
    from pai_cookbook import generate

    reward = str(reward)
    policy = generate.resolve_checkpoint(policy)
    reference = generate.resolve_checkpoint(reference) if reference else policy
    check_reference(policy, reference)
    model, dtype = checkpoint.read_config(policy)
    records = records_of(prompts)
    eval_records = records_of(eval_prompts, "held-out prompt") if eval_prompts is not None else []
    reward_model = reward_model_of(reward, policy)
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
    run = RunConfig.from_checkpoint(policy, optimizer=optimizer_for(config, config.lr), save_dir=save_dir, **steps)
    critic_run = None
    if isinstance(config, PPOConfig):
        start = generate.resolve_checkpoint(critic, language_model=False) if critic else reward_model or policy
        same_tokenizer(policy, start, "critic")
        critic_run = RunConfig.from_checkpoint(start, optimizer=optimizer_for(config, config.critic_lr or config.lr),
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


def optimizer_for(config: GRPOConfig, lr: float) -> OptimizerConfig:
    return OptimizerConfig(lr=lr, min_lr=lr, lr_decay_style="constant", weight_decay=0.0,
                           lr_warmup_iters=config.warmup_steps, clip_grad=config.clip_grad)


