"""Reward models on Megatron-Core: the policy's own transformer with a scalar head, trained on preference pairs.

    config = reward_model.RewardModelConfig(steps=150, lr=1e-4, global_batch_size=16)
    result = reward_model.train("sft/iter_0000200", pairs, config, valid=held_out, save_dir="rm", run_dir="runs/rm")
    result["valid"][-1]["accuracy"]       # share of held-out pairs whose chosen completion scores higher
    convert.megatron_to_hf("rm/iter_0000150", "rm_hf")   # LlamaForSequenceClassification, num_labels=1

A pair is a record {"prompt" (text) or "messages" (the turns before the answer), "chosen", "rejected"
(two completions of it, the chosen one preferred), optionally "margin" (how much it is preferred)}.

The model is the starting checkpoint's GPT with its output layer replaced by `core.modeling.model.ScalarHead`: one
score per position, read at a sequence's last token, the end-of-turn token that closes the completion (a
completion is encoded as the policy writes it: the prompt through the chat template, the completion's text,
the end token; `rlhf`'s rollouts end the same way). The loss is Bradley-Terry's, -log sigmoid(r_chosen -
r_rejected - margin) (InstructGPT; the margin is Llama 2's), averaged over the global batch's pairs as the
training worker averages tokens, so any micro-batch split and data-parallel size gives the same step.
Checkpoints are marked `"head": "reward"`; the language-model code refuses them, and `convert.megatron_to_hf`
writes them as Hugging Face's `...ForSequenceClassification` (what TRL's RewardTrainer trains and reads).
"""

from __future__ import annotations

import math
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
from pai_cookbook.core.configs.rlhf_config import RewardModelConfig
from pai_cookbook.core.launching import inputs
from pai_cookbook.core.launching.inputs import prompt_text
from pai_cookbook.core.launching.jobs import RewardModelJob
from pai_cookbook.core.text import tokenizer


def check_pairs(pairs: Sequence[dict[str, Any]], what: str = "pair") -> list[dict[str, Any]]:
    """Refuse pairs a reward model cannot learn from, naming the pair: no prompt, an empty or missing
    completion, chosen equal to rejected (its loss is log 2 whatever the model does), a margin that is not a
    finite number."""
    pairs = inputs.listed(pairs, f"{what}s", "{'prompt', 'chosen', 'rejected'} records") if pairs is not None else []
    if not pairs:
        raise ConfigError(f"no {what}s: a reward model needs preference pairs {{'prompt', 'chosen', 'rejected'}}.")
    for number, pair in enumerate(pairs, start=1):
        where = f"{what} {number}"
        if not isinstance(pair, dict):
            raise ConfigError(f"{where} is {pair!r:.60} ({type(pair).__name__}); give {{'prompt', 'chosen', 'rejected'}}.")
        inputs.prompt_record(pair, where)
        if not prompt_text(pair).strip():
            raise ConfigError(f"{where} has an empty prompt; remove it or fill it in.")
        for side in ("chosen", "rejected"):
            if not isinstance(pair.get(side), str) or not pair[side].strip():
                raise ConfigError(f"{where} ({prompt_text(pair)[:50]!r}): {side!r} must be a non-empty string, "
                                  f"found {pair.get(side)!r}.")
        if pair["chosen"].strip() == pair["rejected"].strip():
            raise ConfigError(f"{where} ({prompt_text(pair)[:50]!r}): chosen and rejected are the same text "
                              f"({pair['chosen'][:50]!r}); such a pair teaches nothing (its loss is log 2 whatever "
                              f"the model scores). Remove it.")
        margin = pair.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise ConfigError(f"{where}: margin {margin!r} must be a finite number.")
    return pairs


def encode_pair(hf, pair: dict[str, Any], eos: int, chat_template: str) -> list[list[int]]:
    """[chosen ids, rejected ids]: the prompt as the policy sees it, then each completion and the end token,
    as a sampled completion ends."""
    prompt = tokenizer.encode(hf, pair, chat_template)
    return [prompt + hf.encode(pair[side], add_special_tokens=False) + [eos] for side in ("chosen", "rejected")]


def prepare(base: str | Path, pairs: Sequence[dict[str, Any]], config: RewardModelConfig, *,
            valid: Sequence[dict[str, Any]] | None = None, parallel: ParallelConfig | None = None,
            save_dir: str | Path | None = None, overwrite: bool = False) -> RewardModelJob:
    """Check everything about a reward-model run and tokenize its pairs; no worker starts."""
    from pai_cookbook import generate

    base = generate.resolve_checkpoint(base, language_model=False)  # a reward model may continue training
    model, dtype = checkpoint.read_config(base)
    pairs = check_pairs(pairs)
    valid = check_pairs(valid, "held-out pair") if valid else []
    parallel = parallel or ParallelConfig()
    if parallel.sequence_parallel:
        raise ConfigError("sequence_parallel=True: the reward head reads whole hidden states on every "
                          "tensor-parallel rank; train reward models without sequence parallelism.")
    layout.check(model, parallel, purpose="train")
    hf = checkpoint.load_tokenizer(base)
    eos = tokenizer.eos_ids(base / checkpoint.HF_ASSETS, hf)
    if not eos:
        raise ConfigError(f"{base}'s tokenizer names no end-of-sequence token; completions could not end.")
    encoded = [encode_pair(hf, p, eos[0], config.chat_template) for p in pairs]
    encoded_valid = [encode_pair(hf, p, eos[0], config.chat_template) for p in valid or []]
    longest = max(len(ids) for pair in encoded + encoded_valid for ids in pair)
    if longest > model.max_position_embeddings:
        raise ConfigError(f"a pair encodes to {longest} tokens, over the model's {model.max_position_embeddings} "
                          f"positions; shorten it.")
    run = RunConfig.from_checkpoint(
        base, parallel=parallel, save_dir=save_dir, overwrite=overwrite, train_iters=config.steps, seed=config.seed,
        optimizer=OptimizerConfig(lr=config.lr, min_lr=config.lr / 10, lr_warmup_iters=config.warmup_steps,
                                  weight_decay=config.weight_decay, clip_grad=config.clip_grad),
        data=DataConfig(seq_length=longest, micro_batch_size=config.micro_batch_size,
                        global_batch_size=config.global_batch_size))
    return RewardModelJob(run=run, rm=config, train_pairs=encoded, valid_pairs=encoded_valid, pad_id=eos[0],
                          train_margins=[float(p.get("margin", 0.0)) for p in pairs],
                          valid_margins=[float(p.get("margin", 0.0)) for p in valid or []])


def train(base: str | Path, pairs: Sequence[dict[str, Any]], config: RewardModelConfig | None = None, *,
          valid: Sequence[dict[str, Any]] | None = None, parallel: ParallelConfig | None = None,
          nproc_per_node: int = 1, save_dir: str | Path | None = None, overwrite: bool = False,
          run_dir: str | Path = "runs/reward_model", **launch_kwargs: Any) -> dict[str, Any]:
    """Train a reward model from `base` (a cookbook checkpoint: its weights, a new scalar head) under torchrun.

    Returns rank 0's result: {"steps": per step loss, accuracy (of the step's pairs), mean margin
    r_chosen - r_rejected, grad_norm, lr; "valid": [{"step", "accuracy", "loss"}] on `valid`;
    "valid_scores": {"chosen": [...], "rejected": [...]} after the last step; "checkpoint"}.
    run_dir/metrics.jsonl has the per-step figures (`rlhf.history` reads it).
    """
    from pai_cookbook import train as training

    job = prepare(base, pairs, config or RewardModelConfig(), valid=valid, parallel=parallel, save_dir=save_dir,
                  overwrite=overwrite)
    return training.launch_training(job, [job.run], job.check, nproc_per_node=nproc_per_node, run_dir=run_dir,
                                    **launch_kwargs)


def length_baseline(pairs: Sequence[dict[str, Any]]) -> float:
    """Accuracy of the best reward that sees only length: "longer wins" or "shorter wins", whichever is
    right more often on `pairs` (ties count half). A reward model must beat it to have learned content."""
    pairs = check_pairs(pairs)
    longer = sum(0.5 if len(p["chosen"]) == len(p["rejected"]) else float(len(p["chosen"]) > len(p["rejected"]))
                 for p in pairs) / len(pairs)
    return max(longer, 1.0 - longer)
