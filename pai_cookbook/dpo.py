"""Preference tuning without a reward model: DPO, IPO and SimPO on Megatron-Core, at any TP/PP layout.

    prepared = dpo.prepare(pairs, "dpo_set", "sft/iter_0000200", valid=held_out)  # tokenized, reference scored
    result = dpo.train("sft/iter_0000200", "dpo_set", dpo.DPOConfig(beta=0.1, steps=100, lr=5e-7),
                       save_dir="dpo", run_dir="runs/dpo")
    result["valid"][-1]["accuracy"]            # held-out pairs whose chosen answer gains more than the rejected
    kl = dpo.kl_to_reference("dpo", "sft/iter_0000200", held_out_prompts)   # what the policy paid, per answer

A pair is a record {"prompt" (text) or "messages" (the turns before the answer), "chosen", "rejected"}, the same
records `reward_model.train` reads. Each answer is encoded as notebook 06 encodes a conversation (`sft.records.encode`:
the prompt through the chat template, the answer as the assistant's turn through its stop token), and only the final
answer's tokens are scored. A policy's log-probability of an answer is the sum of its tokens' log-probabilities.

`prepare` scores every answer once under the reference (`evaluate.loglikelihood_tokens`, at the run's layout) and
writes them with the tokenized pairs; training reads them and never loads the reference. With LoRA
(`train(..., lora=LoRAConfig(...))`) the reference is the base the adapters start from, so a set prepared on the base
is what TRL computes by disabling the adapters. The losses are `DPOConfig`'s ("sigmoid", "ipo", "simpo"), averaged
over the global batch's pairs, as TRL's DPOTrainer averages them (tests/test_dpo.py holds the two to 1e-5 at step 0
and 1e-4 after three steps).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint, checkpoint_config
from pai_cookbook.core.checkpoints.checkpoint_config import DTYPE_NAMES
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import (
    ConfigError,
    DataConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
)
from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.rlhf_config import DPO_LOSSES, DPOConfig
from pai_cookbook.core.launching.inputs import prompt_text
from pai_cookbook.core.launching.jobs import DPOJob
from pai_cookbook.core.text import tokenizer as tokenizers
from pai_cookbook.core.text.sft_data import SFTError

__all__ = ["DPOConfig", "DPO_LOSSES", "PAIRS_FILE", "encode_pair", "kl_to_reference", "load", "prepare", "train"]

PAIRS_FILE = "pairs.json"
FORMAT = "cookbook-dpo-pairs-1"


def _messages(pair: dict[str, Any]) -> list[dict[str, str]]:
    return [dict(m) for m in pair["messages"]] if "messages" in pair else [{"role": "user", "content": pair["prompt"]}]


def encode_pair(hf, pair: dict[str, Any], template: str | None, stops: list[int], where: str,
                max_length: int) -> dict[str, Any]:
    """A pair as training reads it: per side the ids through the end of the answer and where the answer starts
    (`start`: its first token), the sequence cut at `max_length` tokens on the right (TRL's "keep_start").

    Raises:
        ConfigError: an answer cut to nothing by `max_length`, or one whose template gives it no token."""
    from pai_cookbook.sft import records

    sides = {}
    for side in ("chosen", "rejected"):
        conversation = {"messages": _messages(pair) + [{"role": "assistant", "content": pair[side]}], "where": where}
        try:
            sample = records.encode(hf, conversation, template, stop_ids=stops)
        except SFTError as error:
            raise ConfigError(str(error)) from None
        mask = sample.loss_mask
        if not any(mask):
            raise ConfigError(f"{where}: the template gives the {side} answer no token to score; check the template.")
        end = len(mask) - mask[::-1].index(True)
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        if start >= max_length:
            raise ConfigError(f"{where} ({prompt_text(pair)[:50]!r}): its prompt is {start} tokens, so max_length "
                              f"{max_length} leaves none of the {side} answer to score. Shorten the prompt, raise "
                              f"max_length, or drop the pair.")
        sides[side] = {"ids": sample.ids[:min(end, max_length)], "start": start, "cut": end > max_length}
    return sides


def prepare(pairs: Sequence[dict[str, Any]], out_dir: str | Path, reference: str | Path, *,
            valid: Sequence[dict[str, Any]] | None = None, template: str | None = None,
            max_length: int | None = None, parallel: ParallelConfig | None = None,
            run_dir: str | Path | None = None) -> dict[str, Any]:
    """Check and tokenize preference pairs with the reference's tokenizer, score every answer under the reference
    (one launch at `parallel`) and write the set to `out_dir` (whole or not at all; a set there is replaced).

    Args:
        reference: the checkpoint the policy is pulled towards: the one it starts from (the default in DPO), or the
            base of a LoRA run.
        template: a chat template (a name of `sft.TEMPLATES`, a file, or the text); default the tokenizer's own.
        max_length: tokens per sequence (default the model's positions); longer ones are cut on the right.
    Returns:
        The summary written beside the pairs: counts, lengths, the reference's mean log-probabilities.
    Raises:
        ConfigError: before any worker starts: pairs a preference cannot be learned from (`reward_model.check_pairs`:
        chosen equal to rejected, an empty answer), an answer cut to nothing, a folder holding something else.
    """
    from pai_cookbook import chat_template, evaluate, generate, reward_model
    from pai_cookbook.sft import prepared, records

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / PAIRS_FILE).exists())):
        raise ConfigError(f"{out_dir} holds files that are not a prepared preference set; give an empty or new folder "
                          f"(a prepared set there is replaced, nothing else is).")
    reference = generate.resolve_checkpoint(reference)
    model, dtype = checkpoint.read_config(reference)
    limit = evaluate.max_length(reference) + 1
    max_length = limit if max_length is None else int(max_length)
    if not 2 <= max_length <= limit:
        raise ConfigError(f"max_length={max_length}: a sequence holds 2 to {limit} tokens (the model's positions + 1).")
    splits = {"train": reward_model.check_pairs(pairs, "pair")}
    splits["valid"] = reward_model.check_pairs(valid, "held-out pair") if valid else []
    hf = evaluate.tokenizer(reference)
    template = records.template_text(template)
    if template is None and not getattr(hf, "chat_template", None):
        raise ConfigError(f"{reference}'s tokenizer has no chat template; pass template= one of "
                          f"{sorted(records.TEMPLATES)} or your own.")
    stops = chat_template.stop_ids(hf, reference / checkpoint.HF_ASSETS)
    encoded = {split: [encode_pair(hf, pair, template, stops, f"{'held-out ' if split == 'valid' else ''}pair {i}",
                                   max_length) for i, pair in enumerate(rows, start=1)]
               for split, rows in splits.items()}
    sides = [side for rows in encoded.values() for pair in rows for side in (pair["chosen"], pair["rejected"])]
    scored = evaluate.loglikelihood_tokens(
        reference, [(s["ids"][:s["start"]], s["ids"][s["start"]:]) for s in sides], parallel=parallel,
        precision=PrecisionConfig(dtype=DTYPE_NAMES[dtype]), run_dir=run_dir or out_dir.with_name(out_dir.name + ".logs"),
        show_progress=False)["results"]
    for side, result in zip(sides, scored):
        side["reference"] = result["logprob"]
    summary = {"format": FORMAT, "pairs": len(encoded["train"]), "held_out": len(encoded["valid"]),
               "reference": {"path": str(reference.resolve()), "identity": checkpoint_config.identity(reference)},
               "tokenizer": tokenizers.fingerprint(reference / checkpoint.HF_ASSETS),
               "model": dataclasses.asdict(model), "dtype": DTYPE_NAMES[dtype], "template": template,
               "max_length": max_length, "cut": sum(s["cut"] for s in sides),
               "longest": max(len(s["ids"]) for s in sides),
               "mean_answer_tokens": sum(len(s["ids"]) - s["start"] for s in sides) / len(sides),
               "reference_logprob": {side: sum(p[side]["reference"] for p in encoded["train"]) / len(encoded["train"])
                                     for side in ("chosen", "rejected")}}
    with prepared.replacing(out_dir) as partial:
        (partial / PAIRS_FILE).write_text(json.dumps(summary | encoded))
    return summary


def load(prepared: str | Path) -> dict[str, Any]:
    """A prepared set (`prepare`'s), refused by name where it is not one."""
    path = Path(prepared) / PAIRS_FILE
    if not path.is_file():
        raise ConfigError(f"{prepared} is not a prepared preference set (no {PAIRS_FILE}); write one with "
                          f"dpo.prepare(pairs, {str(prepared)!r}, reference).")
    content = json.loads(path.read_text())
    if content.get("format") != FORMAT:
        raise ConfigError(f"{path} is format {content.get('format')!r}, not {FORMAT!r}; prepare the set again.")
    return content


def check_policy(policy: Path, prepared: dict[str, Any], where: str | Path) -> None:
    """The policy must be the model the reference is (architecture and tokenizer): a log-ratio of two models'
    vocabularies means nothing."""
    model, _ = checkpoint.read_config(policy)
    differ = [k for k, v in dataclasses.asdict(model).items() if json.loads(json.dumps(v)) != prepared["model"].get(k)]
    if differ:
        raise ConfigError(f"the policy {policy} is another model than the reference {where} was prepared with "
                          f"({prepared['reference']['path']}): they differ in {differ}. Prepare the set with the "
                          f"checkpoint the policy starts from.")
    if tokenizers.fingerprint(policy / checkpoint.HF_ASSETS) != prepared["tokenizer"]:
        raise ConfigError(f"the policy {policy} carries another tokenizer than the one {where} was tokenized with "
                          f"({prepared['reference']['path']}); token ids would not mean the same text. Prepare the set "
                          f"with the policy's own checkpoint.")


def job_for(policy: str | Path, prepared: str | Path, config: DPOConfig, *, lora: LoRAConfig | None = None,
            parallel: ParallelConfig | None = None, save_dir: str | Path | None = None,
            overwrite: bool = False) -> DPOJob:
    """Check everything about a preference-tuning run; no worker starts."""
    from pai_cookbook import generate

    policy = generate.resolve_checkpoint(policy)
    content = load(prepared)
    check_policy(policy, content, prepared)
    model, _ = checkpoint.read_config(policy)
    parallel = parallel or ParallelConfig()
    layout.check(model, parallel, purpose="train")
    if lora is not None and not isinstance(lora, LoRAConfig):
        raise ConfigError(f"lora={lora!r}; give a LoRAConfig(...) or None.")
    decay = {"lr_decay_style": config.lr_decay_style, "min_lr": config.lr if config.lr_decay_style == "constant"
             else config.lr / 10}
    run = RunConfig.from_checkpoint(
        policy, parallel=parallel, save_dir=save_dir, overwrite=overwrite, train_iters=config.steps, seed=config.seed,
        lora=lora, optimizer=OptimizerConfig(lr=config.lr, lr_warmup_iters=config.warmup_steps,
                                             weight_decay=config.weight_decay, clip_grad=config.clip_grad,
                                             adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                                             adam_eps=config.adam_eps, **decay),
        data=DataConfig(seq_length=content["longest"], micro_batch_size=config.micro_batch_size,
                        global_batch_size=config.global_batch_size))
    eos = tokenizers.eos_ids(policy / checkpoint.HF_ASSETS, checkpoint.load_tokenizer(policy))
    fields = {f"{split}_{key}": [[p[side][name] for side in ("chosen", "rejected")] for p in content[split]]
              for split in ("train", "valid") for key, name in (("ids", "ids"), ("starts", "start"),
                                                                ("reference", "reference"))}
    return DPOJob(run=run, dpo=config, pad_id=eos[0] if eos else 0, **fields)


def train(policy: str | Path, prepared: str | Path, config: DPOConfig | None = None, *, lora: LoRAConfig | None = None,
          parallel: ParallelConfig | None = None, nproc_per_node: int = 1, save_dir: str | Path | None = None,
          overwrite: bool = False, run_dir: str | Path = "runs/dpo", **launch_kwargs: Any) -> dict[str, Any]:
    """Tune `policy` on a prepared preference set under torchrun.

    Returns rank 0's result: {"steps": per step loss, accuracy, margin, chosen_reward, rejected_reward, chosen_logp,
    rejected_logp (the policy's, summed over the answer's tokens, for SimPO too, whose loss takes their mean), grad_norm,
    lr; "valid": the same figures on the held-out pairs before the first step, every `eval_interval` steps and after
    the last, each with its "step" and "pairs" (how many were scored: whole micro-batches on every data-parallel rank;
    those left over are said before launch); "checkpoint"}.
    run_dir/metrics.jsonl has the per-step figures (`rlhf.history` reads it).
    """
    from pai_cookbook import train as training

    job = job_for(policy, prepared, config or DPOConfig(), lora=lora, parallel=parallel, save_dir=save_dir,
                  overwrite=overwrite)
    return training.launch_training(job, [job.run], job.check, nproc_per_node=nproc_per_node, run_dir=run_dir,
                                    **launch_kwargs)


def kl_to_reference(policy: str | Path, reference: str | Path, prompts: Sequence[str | dict[str, Any]], *,
                    samples: int = 4, max_new_tokens: int = 32, seed: int = 99, parallel: ParallelConfig | None = None,
                    run_dir: str | Path = "runs/kl") -> dict[str, Any]:
    """KL(policy || reference) per answer on `prompts`: `samples` answers per prompt drawn from the policy itself
    (temperature 1, neither top-k nor top-p), each scored under both models; the mean of log π(y|x) - log π_ref(y|x)
    over those answers is an unbiased estimate of the KL of the answer distributions (summed over its tokens).

    Returns:
        {"kl": the estimate, "stderr": its standard error over the answers, "answers": how many, "records": each
        answer with its two log-probabilities}.
    """
    from pai_cookbook import evaluate, generate
    from pai_cookbook.core.configs.generation import GenerationConfig
    from pai_cookbook.core.launching import inputs
    from pai_cookbook.rlhf import check_reference

    policy, reference = generate.resolve_checkpoint(policy), generate.resolve_checkpoint(reference)
    check_reference(policy, reference)
    asked = [inputs.prompt_record(p, f"prompt {i}") for i, p in enumerate(prompts, start=1) for _ in range(samples)]
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0, top_k=0, top_p=0.0,
                              repetition_penalty=1.0, batch_size=min(len(asked), 64), seed=seed)
    records = generate.generate(policy, asked, config, parallel=parallel, run_dir=Path(run_dir) / "sample",
                                show_progress=False)["records"]
    hf = evaluate.tokenizer(policy)
    requests = [(tokenizers.encode(hf, record, config.chat_template), record["completion_ids"]) for record in records
                if record["completion_ids"]]
    scores = {name: [r["logprob"] for r in evaluate.loglikelihood_tokens(
        ckpt, requests, parallel=parallel, run_dir=Path(run_dir) / name, show_progress=False)["results"]]
              for name, ckpt in (("policy", policy), ("reference", reference))}
    gaps = [p - r for p, r in zip(scores["policy"], scores["reference"])]
    mean = sum(gaps) / len(gaps)
    spread = math.sqrt(sum((g - mean) ** 2 for g in gaps) / max(len(gaps) - 1, 1) / len(gaps))
    kept = [r for r in records if r["completion_ids"]]
    return {"kl": mean, "stderr": spread, "answers": len(gaps),
            "records": [r | {"logprob": p, "reference_logprob": q}
                        for r, p, q in zip(kept, scores["policy"], scores["reference"])]}
