"""The Hugging Face side of every comparison: what `transformers` computes on the same inputs.

`hf_logits` is the reference of the logits parity (`parity`), `hf_generate` the reference of greedy and
sampled generation (`generate`), `hf_complete` the quick look at an exported model's text,
`hf_packed_token_losses` the reference of fine-tuning's per-token loss on packed rows (`sft`), `peft_sft` the
reference of LoRA training (`RunConfig.lora`), `trl_reward_model`, `trl_grpo` and `trl_dpo` TRL's trainers beside
the cookbook's reward model, GRPO and DPO.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.launching.progress import quiet_transformers
from pai_cookbook.core.measures.logit_parity import hf_logits, hf_model
from pai_cookbook.core.text.tokenizer import eos_ids
from pai_cookbook.generate import GenerationConfig

__all__ = ["TRL_RENAMED_API", "hf_complete", "hf_generate", "hf_logits", "hf_packed_token_losses", "peft_sft", "trl_dpo",
           "trl_grpo", "trl_reward_model"]

# transformers 5's deprecations of what TRL 1.16 still calls: `gradient_checkpointing` (an argument),
# `is_gradient_checkpointing`, `gradient_checkpointing_enable`/`_disable` (model methods).
TRL_RENAMED_API = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"


@contextlib.contextmanager
def _quiet_trl() -> Iterator[None]:
    """While a TRL trainer is built and runs: transformers 5's deprecations of what TRL 1.16 calls (nothing to
    change here) are ignored, and `datasets` draws no text bar per tokenizing pass (nothing to watch at this size),
    nor transformers one per model load."""
    import warnings

    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings(), quiet_transformers():
            warnings.filterwarnings("ignore", message=TRL_RENAMED_API, category=FutureWarning)
            yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def hf_packed_token_losses(hf_dir: str | Path, batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """transformers' per-token losses [rows, seq] of each batch of packed SFT rows (`sft.batch`, `sft.load`,
    `sft.global_batch`), fp32, padding-free (`_packed_losses`)."""
    model = hf_model(hf_dir)
    with torch.no_grad():
        return [_packed_losses(model, batch) for batch in batches]


def _packed_losses(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`model`'s per-token losses [rows, seq] of a batch of packed SFT rows, differentiable. Each row's
    conversations are laid end to end without padding, positions restarting at 0 for each (transformers reads
    the boundaries from the position ids and keeps attention inside each conversation), `use_cache=False`.
    Positions holding padding get 0."""
    tokens, labels, document = batch["tokens"], batch["labels"], batch["document"]
    index = torch.arange(tokens.shape[1])
    out = []
    for r in range(tokens.shape[0]):
        real = document[r] >= 0
        starts = torch.ones_like(real)
        starts[1:] = document[r, 1:] != document[r, :-1]
        positions = index - torch.cummax(torch.where(starts, index, 0), 0).values  # 0 at each conversation
        logits = model(tokens[r, real][None], position_ids=positions[real][None], use_cache=False).logits[0]
        losses = torch.nn.functional.cross_entropy(logits.float(), labels[r, real], reduction="none")
        out.append(torch.zeros(tokens.shape[1]).index_put((torch.nonzero(real)[:, 0],), losses))
    return torch.stack(out)


def peft_sft(hf_dir: str | Path, run: Any, steps: int | None = None) -> dict[str, Any]:
    """PEFT's LoRA on transformers, trained as the cookbook trains `run` (a RunConfig of an SFT set with `lora`):
    the library reference of LoRA training. The same global batches (`sft_data.global_batch`), each step's loss
    the batch's weighted loss sum over its count; PEFT's adapters on the Hugging Face modules of the run's
    targets, each A set to what the cookbook draws for it (`core.modeling.lora.full_a`, same seed) and B zero;
    torch's AdamW with the run's betas, eps and weight decay, the gradient clipped to its global norm, and
    transformers' cosine-to-min_lr schedule after linear warmup (Megatron-Core's: 0 at step 0 when warming up).

    Returns:
        {"losses": per step, "trainable": PEFT's trainable parameters}.
    """
    import re

    import peft
    from transformers import get_scheduler

    from pai_cookbook.core.configs.lora import PEFT_NAMES, peft_part
    from pai_cookbook.core.modeling.lora import full_a
    from pai_cookbook.core.text import sft_data

    lora, opt, data = run.lora, run.optimizer, run.data
    if opt.lr_decay_style != "cosine" or data.source != "sft":
        raise ValueError(f"the reference trains SFT sets with the cosine schedule, not {data.source}/{opt.lr_decay_style}")
    modules = sorted(name for target in lora.targets for name in PEFT_NAMES[target])
    model = peft.get_peft_model(hf_model(hf_dir).eval(), peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules, bias="none"))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1)) + 1
                a = module.lora_A["default"].weight
                a.copy_(full_a(lora, run.seed, layer, *peft_part(name.rsplit(".", 1)[-1]), a.shape[1]))
                module.lora_B["default"].weight.zero_()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                  weight_decay=opt.weight_decay)
    schedule = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=opt.lr_warmup_iters,
                             num_training_steps=run.train_iters, scheduler_specific_kwargs={"min_lr": opt.min_lr})
    rows, losses = sft_data.load(data.paths[0], "train"), []
    for step in range(run.train_iters if steps is None else steps):
        batches = sft_data.global_batch(rows, step, data.global_batch_size, data.micro_batch_size, 0, 1, run.seed,
                                        data.loss_average)
        count, total = max(sum(int(b["loss_count"]) for b in batches), 1), 0.0
        optimizer.zero_grad()
        for batch in batches:
            loss = (_packed_losses(model, batch) * batch["loss_mask"]).sum() / count
            loss.backward()
            total += loss.item()
        if opt.clip_grad:
            torch.nn.utils.clip_grad_norm_(trainable, opt.clip_grad)
        optimizer.step()
        schedule.step()
        losses.append(total)
    return {"losses": losses, "trainable": sum(p.numel() for p in trainable)}


# --------------------------------------------------------------------------------------------------
def hf_generate(hf_dir: str | Path, prompt_ids: Sequence[Sequence[int]], config: GenerationConfig,
                device: str = "cpu") -> dict[str, Any]:
    """`transformers` `generate` on the same token ids and settings, one prompt at a time (no padding), on `device`.

    Returns:
        {"tokens": generated ids per prompt (a final end-of-sequence token dropped, as Megatron-Core
        does), "tokens_per_s", "seconds"}.
    """
    from transformers import AutoTokenizer

    dtype = {None: torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.dtype]
    model = hf_model(hf_dir, dtype, device)
    eos = eos_ids(hf_dir, AutoTokenizer.from_pretrained(hf_dir)) + list(config.eos_token_ids)
    # HF switches top-k off with 0 and top-p off with 1.0 (Megatron-Core: top_p 0.0).
    decoding = ({"do_sample": False} if config.greedy else
                {"do_sample": True, "top_k": config.top_k, "top_p": config.top_p or 1.0,
                 "temperature": config.temperature})
    outputs, start = [], time.perf_counter()
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([list(ids)], device=device), max_new_tokens=config.max_new_tokens,
                                 repetition_penalty=config.repetition_penalty,
                                 eos_token_id=None if config.ignore_eos else eos,
                                 pad_token_id=eos[0] if eos else None, **decoding)
            new = out[0, len(ids):].tolist()
            outputs.append(new[:-1] if new and new[-1] in eos and not config.ignore_eos else new)
    seconds = time.perf_counter() - start
    return {"tokens": outputs, "seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds}


def hf_complete(hf_dir: str | Path, prompts: Sequence[str], max_new_tokens: int = 32, min_new_tokens: int = 0,
                no_repeat_ngram_size: int = 0) -> list[str]:
    """Greedy completions of `prompts` by the Hugging Face model in `hf_dir` (fp32, on the CPU).

    Special tokens other than end-of-sequence (`<unk>`, `<s>`) are never chosen: they decode to nothing,
    and a small model trained on text with unknown characters predicts them often. min_new_tokens keeps
    end-of-sequence from ending a completion earlier (tiny demo models stop early); no_repeat_ngram_size
    (Hugging Face's rule) keeps a small model from looping on one phrase.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = hf_model(hf_dir)
    silent = [i for i in tokenizer.all_special_ids if i != tokenizer.eos_token_id]
    completions = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, suppress_tokens=silent or None,
                                 no_repeat_ngram_size=no_repeat_ngram_size)
            completions.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return completions


def trl_reward_model(hf_dir: str | Path, pairs: Sequence[dict[str, Any]], valid: Sequence[dict[str, Any]],
                     out_dir: str | Path, *, steps: int, lr: float, batch_size: int, warmup_steps: int = 0,
                     seed: int = 0) -> dict[str, Any]:
    """TRL's RewardTrainer on the same pairs from the same Hugging Face model (a fresh one-label head on it):
    the library reference of `reward_model.train`. The optimizer is set as the cookbook's (AdamW, betas 0.9
    and 0.95, no weight decay, gradient clip 1, cosine to lr / 10 after linear warmup); the tokenization
    and the head are TRL's own (it reads the score where transformers does, at the last non-padding token).

    Returns:
        {"accuracy": held-out pairwise accuracy, "losses": per logged step, "seconds"}.
    """
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import RewardConfig, RewardTrainer

    def record(pair: dict[str, Any]) -> dict[str, Any]:
        if "messages" in pair:
            return {"prompt": pair["messages"], "chosen": [{"role": "assistant", "content": pair["chosen"]}],
                    "rejected": [{"role": "assistant", "content": pair["rejected"]}]}
        return {"prompt": pair["prompt"], "chosen": pair["chosen"], "rejected": pair["rejected"]}

    with _quiet_trl():
        config = RewardConfig(
            output_dir=str(out_dir), max_steps=steps, learning_rate=lr, per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=len(valid), warmup_steps=warmup_steps, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1}, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
            seed=seed, data_seed=seed, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            disable_tqdm=True, dataloader_drop_last=True)
        trainer = RewardTrainer(model=str(hf_dir), args=config,
                                train_dataset=Dataset.from_list([record(p) for p in pairs]),
                                eval_dataset=Dataset.from_list([record(p) for p in valid]))
        trainer.remove_callback(PrinterCallback)  # a dict printed per step; the losses are in the log history
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        metrics = trainer.evaluate()
    return {"accuracy": metrics["eval_accuracy"], "seconds": seconds,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}


def trl_dpo(hf_dir: str | Path, prepared: str | Path, out_dir: str | Path, config: Any) -> dict[str, Any]:
    """TRL's DPOTrainer on a prepared preference set (`dpo.prepare`) from the same Hugging Face model in fp32: the
    library reference of `dpo.train` with `config` (a `DPOConfig` whose loss is "sigmoid" or "ipo", without label
    smoothing, which TRL 1.16's "sigmoid" no longer takes). TRL is given the set's own token ids (prompt, chosen and
    rejected answers), so that what is compared is the training, not two tokenizations; its reference is a frozen
    copy of the model, scored in each step as TRL does. Every step sees the whole set (one batch of all its pairs);
    the optimizer is the cookbook's: AdamW with the config's betas and eps, the gradient clipped to `clip_grad`, a constant
    learning rate.

    Returns:
        {"losses": per step, as TRL logs it (before that step's update), "accuracies", "margins", "model": the
        trained model}.
    """
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    from pai_cookbook import dpo
    from pai_cookbook.core.configs.config import OptimizerConfig
    from pai_cookbook.core.text import tokenizer

    if config.loss not in ("sigmoid", "ipo") or config.label_smoothing or config.lr_decay_style != "constant" \
            or config.warmup_steps:
        raise ValueError(f"the TRL reference takes sigmoid or IPO losses at a constant rate, not {config}")
    rows = []
    for pair in dpo.load(prepared)["train"]:
        chosen, rejected = pair["chosen"], pair["rejected"]
        if chosen["ids"][:chosen["start"]] != rejected["ids"][:rejected["start"]]:
            raise ValueError("a pair whose two sides render the prompt differently; TRL takes one prompt per pair")
        rows.append({"prompt_ids": chosen["ids"][:chosen["start"]], "chosen_ids": chosen["ids"][chosen["start"]:],
                     "rejected_ids": rejected["ids"][rejected["start"]:]})

    class Pretokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # the set's ids, as they are
            return dataset

    opt = OptimizerConfig(adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps)
    with _quiet_trl():
        args = DPOConfig(
            output_dir=str(out_dir), max_steps=config.steps, learning_rate=config.lr, per_device_train_batch_size=len(rows),
            lr_scheduler_type="constant", adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_epsilon=opt.adam_eps,
            weight_decay=config.weight_decay, max_grad_norm=config.clip_grad, beta=config.beta, loss_type=[config.loss],
            max_length=None, seed=config.seed, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
            disable_tqdm=True, dataloader_drop_last=True)
        trainer = Pretokenized(model=hf_model(hf_dir), ref_model=hf_model(hf_dir), args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer.load(hf_dir))
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": [entry["loss"] for entry in logged],
            "accuracies": [entry.get("rewards/accuracies") for entry in logged],
            "margins": [entry.get("rewards/margins") for entry in logged], "model": trainer.model}


def trl_grpo(hf_dir: str | Path, prompts: Sequence[dict[str, Any]], reward: str, out_dir: str | Path, *, steps: int,
             lr: float, prompts_per_step: int, group_size: int, max_new_tokens: int, epochs: int = 1,
             kl_coef: float = 0.04, warmup_steps: int = 0, seed: int = 0) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same prompts and reward from the same Hugging Face model: the library reference
    of `rlhf.grpo`. Set as the cookbook's run: `prompts_per_step` x `group_size` completions per step sampled
    at temperature 1 without top-k/top-p, `epochs` optimizer steps on each batch (TRL's num_iterations), the
    clipped surrogate with a k3 KL penalty `kl_coef` to the start, averaged per token over the batch (TRL's
    "dapo" loss), group advantages over the unbiased standard deviation, Adam (betas 0.9, 0.95, no weight decay,
    clip 1) at a constant `lr` after `warmup_steps` optimizer steps of linear warmup. Sampling is
    transformers' `generate` and the prompt order TRL's own, so the curves agree in shape, not step for step.

    Args:
        reward: "module:function" as `rlhf.grpo` takes it; each completion's text and its prompt's record go in.
    Returns:
        {"rewards": the mean reward of each step's completions, "kl": per step, "seconds"}.
    """
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from pai_cookbook import rlhf

    function = rlhf.resolve_reward(reward)
    records = [dict(p) for p in prompts]

    def reward_func(prompts, completions, record_index, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [rlhf.score(function, text, records[i]) for text, i in zip(texts, record_index)]

    reward_func.__name__ = reward.rpartition(":")[2]
    rows = [{"prompt": r["messages"] if "messages" in r else r["prompt"], "record_index": i} for i, r in enumerate(records)]
    rows_per_step = prompts_per_step * group_size
    with _quiet_trl():
        config = GRPOConfig(
            output_dir=str(out_dir), max_steps=steps * epochs, learning_rate=lr, per_device_train_batch_size=rows_per_step,
            gradient_accumulation_steps=1, steps_per_generation=1, num_generations=group_size, num_iterations=epochs,
            max_completion_length=max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, beta=kl_coef, epsilon=0.2,
            loss_type="dapo", scale_rewards="group", warmup_steps=warmup_steps,
            lr_scheduler_type="constant_with_warmup", adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, seed=seed,
            data_seed=seed, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
        trainer = GRPOTrainer(model=str(hf_dir), reward_funcs=reward_func, args=config,
                              train_dataset=Dataset.from_list(rows))
        trainer.remove_callback(PrinterCallback)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    # TRL logs the batch's reward on the optimizer step that sampled it (the first of its `epochs`)
    per_batch = [entry for entry in trainer.state.log_history if "reward" in entry]
    return {"rewards": [entry["reward"] for entry in per_batch], "kl": [entry.get("kl") for entry in per_batch],
            "seconds": seconds}
