"""The training library every training worker shares (train, sweep, reward models, GRPO/PPO): Megatron DDP, Megatron's
optimizer and pipeline schedules, in the steps of Megatron-LM's `run_simple_mcore_train_loop.py`, each a function:
`build` (model provider, DDP, optimizer, LR schedule), `forward_step`, `train_step`, `evaluate`, and `train`, the
loop a `RunConfig` runs. What a run keeps between steps and launches (its log, saves, resume) is `run_state`. Not a
worker itself: the workers (`workers/train.py`, ...) import it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import RunConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.machine.runtime import DeviceInfo
from pai_cookbook.core.measures import parameters
from pai_cookbook.core.measures.memory_probe import MemoryProbe
from pai_cookbook.core.measures.router_stats import RouterStats
from pai_cookbook.core.modeling import fp8, lora
from pai_cookbook.core.modeling.model import torch_dtype
from pai_cookbook.core.text import indexed_data, sft_data, tokenizer
from pai_cookbook.workers.models import build_model
from pai_cookbook.workers.run_state import StepLog, restore, save_if_due, stop_if_non_finite

MAX_SYNTHETIC_STRIDE = 8
"""Synthetic samples are progressions a, a+b, a+2b, ... (mod vocab) with 1 <= b <= this."""


def synthetic_batches(config: RunConfig, step: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of one step: seeded, learnable sequences, identical on every layout.

    Each sample is an arithmetic progression modulo the vocabulary with a random start and stride:
    after two tokens the rest is predictable, so a model that learns drives the loss from ln(vocab)
    towards zero. The global batch of step `step` is drawn whole from a generator seeded with
    (seed, step), then split by DP rank and into micro-batches, so every layout sees the same samples.
    """
    data = config.data
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    start = torch.randint(0, config.model.vocab_size, (data.global_batch_size, 1), generator=generator)
    stride = torch.randint(1, MAX_SYNTHETIC_STRIDE + 1, (data.global_batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(data.seq_length + 1)) % config.model.vocab_size
    per_rank = data.global_batch_size // dp_size
    mine = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [{"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(),
             "loss_mask": torch.ones(mb.shape[0], data.seq_length)} for mb in mine.split(data.micro_batch_size)]


def loss_func(loss_mask: torch.Tensor, count: torch.Tensor, scale: float, output_tensor: torch.Tensor):
    """The micro-batch's weighted loss sum times `scale` (`per_token_scale`), and its sum and count to report."""
    losses = output_tensor.float().view(-1)
    total = torch.sum(losses * loss_mask.view(-1).float())
    report = torch.stack([total.detach().clone(), count.to(total)])
    return total * scale, {"lm loss": report}


def per_token_scale(batches: list[dict[str, torch.Tensor]]) -> float:
    """What turns a micro-batch's loss sum into its share of the global batch's per-token (or per-sample)
    mean: micro-batches x DP / the global batch's loss count. Megatron-Core's schedule then divides by the
    micro-batches and DDP averages over DP, so the gradient is d(global sum) / (global count) for any
    split and DP size (tests/test_sft.py: 1x8, 4x2, 8x1, DP=2 within 1e-5).

    Megatron-Core's own `calculate_per_token_loss` does the same after the fact, but 0.16 rescales MoE aux
    losses by the local token count, which under sequence parallelism changed the router's training
    (TP2 x EP2: a token in 512 routed differently from step 1, losses 8e-5 apart instead of 2.4e-7,
    measured); counting the global batch before its forward keeps the aux losses on the default path.
    """
    from megatron.core import parallel_state as ps

    count = torch.tensor([float(sum(int(b["loss_count"]) for b in batches))], dtype=torch.float64,
                         device=runtime.collective_device())
    torch.distributed.all_reduce(count, group=ps.get_data_parallel_group())
    return len(batches) * ps.get_data_parallel_world_size() / max(float(count.item()), 1.0)


def model_forward(model: torch.nn.Module, batch: dict[str, Any], labels: bool = True) -> torch.Tensor:
    """The model on one micro-batch: per-token losses (with `labels`) or logits.

    Packed SFT rows keep attention inside each conversation: with `cu_seqlens` (Transformer Engine, see
    `forward_backward`) as Megatron-Core's THD packed sequences; otherwise as the block-diagonal causal mask
    of their `document` ids (Megatron-Core 0.16's local attention refuses `packed_seq_params`).
    """
    device = next(model.parameters()).device
    tokens = batch["tokens"].to(device)
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    mask = packed = None
    if "cu_seqlens" in batch:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = batch["cu_seqlens"].to(device=device, dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])
    elif "document" in batch:
        mask = sft_data.attention_mask(batch["document"].to(device))
    return model(tokens, position_ids, attention_mask=mask, labels=batch["labels"].to(device) if labels else None,
                 packed_seq_params=packed)


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """One micro-batch forward; returns per-token losses and the function that reduces them."""
    batch = next(data_iterator)
    output = model_forward(model, batch)
    loss_mask = batch["loss_mask"].to(output.device)
    return output, partial(loss_func, loss_mask, batch["loss_count"], batch["loss_scale"])


def build(config: RunConfig, device: DeviceInfo, head: str = "lm"):
    """Model chunks wrapped in Megatron DDP, the Megatron optimizer and the LR schedule (`head`: see
    `core.modeling.model.build_model`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = config.optimizer
    chunks = build_model(config.model, config.parallel, config.precision, device, config.seed, config.memory, head,
                         initialize=config.lora is None)
    if config.lora is not None:  # the base first, then the adapters beside its frozen weights: only they train
        checkpoint.load(chunks, config.checkpoint.load_dir)
        lora.add_adapters(chunks, config.lora, config.seed)
        # A frozen base stays frozen: DeepSeek-V3's router bias (Megatron-Core's expert-bias update, which is no
        # gradient step) would move with the routed tokens, and the adapter checkpoint holds no bias to merge.
        for chunk in chunks:
            chunk.config.moe_router_bias_update_rate = 0.0
    tconfig = chunks[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=opt.use_distributed_optimizer)
    model = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk) for chunk in chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                        clip_grad=opt.clip_grad, bf16=config.precision.dtype == "bf16",
                        params_dtype=torch_dtype(config.precision),
                        use_distributed_optimizer=opt.use_distributed_optimizer),
        model,
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if opt.lr_warmup_iters else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_iters, lr_decay_steps=config.train_iters,
        lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=config.train_iters, wd_incr_style="constant",
        # a resume follows the run asked for (train.preflight says what changed), not the checkpoint's schedule
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )
    if device.cpu_converters:  # the CPU path's converter (pai_cookbook.cpu); GPUs step with TE's or Apex's fused Adam
        from pai_cookbook.cpu import adam

        adam.fuse_adam(optimizer)
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer, scheduler


def global_mean_loss(reports: list[dict[str, torch.Tensor]]) -> float:
    """Loss of the whole global batch (its loss sum over its count), available on every rank.

    Losses exist on the last pipeline stage only; each DP replica's TP-rank-0 contributes its sums and
    counts, and one all-reduce over the world adds them up.
    """
    total, count = global_sums(reports, "lm loss", 2).tolist()
    return total / max(count, 1.0)


def global_sums(reports: list[dict[str, torch.Tensor]], key: str, width: int) -> torch.Tensor:
    """The sums a loss function reported under `key` (`width` figures per micro-batch), added over the
    global batch and returned on every rank, on the CPU, in float64."""
    from megatron.core import parallel_state as ps

    value = torch.zeros(width, dtype=torch.float64, device=runtime.collective_device())
    if reports and ps.get_tensor_model_parallel_rank() == 0:
        value += torch.stack([r[key].double().to(value.device) for r in reports]).sum(0)
    torch.distributed.all_reduce(value)
    return value.cpu()


def gather_rows(mine: list[Any] | None) -> list[Any]:
    """Every data-parallel rank's per-row results in data-parallel order, on every rank, from the ranks that
    hold them (the last pipeline stage's first tensor-parallel rank; the others' `mine` is ignored)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() != 0:
        mine = None
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (ps.get_data_parallel_rank(), mine))
    by_rank = dict(entry for entry in gathered if entry[1] is not None)
    return [value for rank in sorted(by_rank) for value in by_rank[rank]]


def micro_batches(config: RunConfig, dataset: Any, step: int, shuffle: bool = True) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of global batch `step`, from the dataset or the synthetic source (an SFT
    set's rows are reshuffled every epoch when `shuffle`; validation reads them in order)."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    gbs, mbs = config.data.global_batch_size, config.data.micro_batch_size
    if dataset is None:
        batches = synthetic_batches(config, step, dp_rank, dp_size)
    elif config.data.source == "sft":
        return sft_data.global_batch(dataset, step, gbs, mbs, dp_rank, dp_size, config.seed,
                                     config.data.loss_average, shuffle)
    else:
        batches = indexed_data.global_batch(dataset, step, gbs, mbs, dp_rank, dp_size)
    for mb in batches:  # pretraining rows: every position is one sample's token
        mb["loss_mask"], mb["loss_count"] = sft_data.loss_weights(mb["loss_mask"], None, config.data.loss_average)
    return batches


def forward_backward(config: RunConfig, model, batches: list[dict[str, torch.Tensor]], forward_only: bool,
                     thd: bool = False):
    """Megatron-Core's schedule over `batches`; `thd`: packed SFT rows go in as THD sequences, which Transformer
    Engine's attention takes (`DeviceInfo.transformer_engine`; the local spec attends them with a block mask)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    scale = per_token_scale(batches)
    batches = [b | {"loss_scale": scale} for b in batches]
    seq_length, micro_batch_size = config.data.seq_length, config.data.micro_batch_size
    if "document" in batches[0] and thd:
        # THD: each micro-batch's rows laid end to end as one sequence with the conversations' boundaries;
        # the pipeline stages pass activations of that shape ([rows x seq, 1, hidden]) to each other
        batches = [sft_data.thd(b) for b in batches]
        seq_length, micro_batch_size = seq_length * micro_batch_size, 1
    # One iterator per model chunk: with virtual pipeline each chunk consumes the same micro-batches.
    iterators = [iter(batches) for _ in model]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=seq_length,
        forward_only=forward_only,
    )


def evaluate(config: RunConfig, model, dataset: Any, thd: bool = False) -> float:
    """Mean validation loss over config.eval_iters global batches (forward only)."""
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        losses = [global_mean_loss(forward_backward(config, model, micro_batches(config, dataset, i, False), True, thd))
                  for i in range(config.eval_iters)]
    for chunk in model:
        chunk.train()
    return sum(losses) / len(losses)


def train_step(config: RunConfig, model, optimizer, scheduler, step: int, dataset: Any = None,
               probe: MemoryProbe | None = None, thd: bool = False) -> dict[str, float]:
    """One optimizer step over the global batch (gradient accumulation over micro-batches); `probe` counts what the
    rank holds (`core.measures.memory_probe`)."""
    batches = micro_batches(config, dataset, step)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with probe.activations(model) if probe else contextlib.nullcontext():
        reports = forward_backward(config, model, batches, forward_only=False, thd=thd)
    _, grad_norm, _ = optimizer.step()
    if probe:
        probe.after_step(model, optimizer)
    lr = optimizer.param_groups[0]["lr"]
    scheduler.step(increment=1)
    return {"loss": global_mean_loss(reports), "grad_norm": float(grad_norm or 0.0), "lr": float(lr)}




def train(config: RunConfig, device: DeviceInfo, log_dir: str | Path | None = None,
          progress: tuple[str, int, int] | None = None) -> dict[str, Any]:
    """Run (or continue) training up to config.train_iters; returns this invocation's history.

    log_dir: where metrics.jsonl and TensorBoard go (default: the launch's run folder).
    progress: (name, steps before this run, steps in all) when this run is one of a sweep's.
    """
    model, optimizer, scheduler = build(config, device)
    first_step, started_from = restore(config, model, optimizer, scheduler)
    train_set = valid_set = None
    if config.data.source == "indexed":
        train_set, valid_set = indexed_data.build_datasets(config, config.eval_iters)
    elif config.data.source == "sft":
        train_set = sft_data.load(config.data.paths[0], "train")
        valid_set = sft_data.load(config.data.paths[0], "valid") if config.eval_interval else None
    ckpt = config.checkpoint
    assets = Path(ckpt.load_dir) / checkpoint.HF_ASSETS if ckpt.load_dir else _dataset_tokenizer(config)
    if config.data.source == "sft":  # the chat template the set was rendered with replaces the tokenizer's own
        assets = [folder for folder in (assets, Path(config.data.paths[0])) if folder is not None]
    tokens_per_step = config.data.global_batch_size * config.data.seq_length
    history: list[dict[str, float]] = []
    valid_losses: list[tuple[int, float]] = []
    saved = None
    log = StepLog(config, device, fresh=first_step == 0, log_dir=log_dir)
    name, offset, total = progress or (None, 0, config.train_iters)
    router = RouterStats([m.module for m in model], config) if config.model.is_moe else None
    fp8_backend = config.precision.fp8.decided_backend if config.precision.fp8 is not None else None
    probe = MemoryProbe() if config.measure_memory else None
    at_start = None
    if first_step == 0 and valid_set is not None and config.eval_interval:  # the "before" of every before/after
        at_start = evaluate(config, model, valid_set, device.transformer_engine)
        valid_losses.append((0, at_start))
        if fp8_backend == "emulated":
            fp8.collect([m.module for m in model])  # validation's quantizations are not the first step's
    start = time.perf_counter()
    for step in range(first_step, config.train_iters):
        step_start = time.perf_counter()
        history.append(train_step(config, model, optimizer, scheduler, step, train_set, probe,
                                  device.transformer_engine))
        history[-1] |= log.throughput(time.perf_counter() - step_start)
        stop_if_non_finite(config, log, step + 1, history[-1], started_from)
        if at_start is not None and step == 0:  # logged with the first step: metrics.jsonl's records are steps
            history[-1]["valid_loss_at_start"] = at_start
        if router is not None:
            history[-1] |= router.step()
        if fp8_backend == "emulated":  # per linear and operand: amax, scale, overflow and underflow fractions
            history[-1]["fp8"] = fp8.collect([m.module for m in model])
        done = step + 1
        last = done == config.train_iters
        if valid_set is not None and config.eval_interval and (done % config.eval_interval == 0 or last):
            valid_losses.append((done, evaluate(config, model, valid_set, device.transformer_engine)))
            history[-1]["valid_loss"] = valid_losses[-1][1]
            if fp8_backend == "emulated":
                fp8.collect([m.module for m in model])  # validation's quantizations are not the next step's
        saved = save_if_due(config, model, optimizer, scheduler, done, assets) or saved
        log.write(done, history[-1])
        if worker.rank() == 0 and (done % config.log_interval == 0 or last):
            shown = ("loss", "lr", "tokens_per_s") + (("min_load", "max_load") if router else ())
            worker.progress(offset + done, total, **{k: history[-1][k] for k in shown} | ({"run": name} if name else {}))
    log.close()
    if router is not None:
        router.close()
    elapsed = time.perf_counter() - start
    return {
        "first_step": first_step,
        "started_from": started_from,
        "losses": [h["loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "lrs": [h["lr"] for h in history],
        "valid_losses": valid_losses,
        "tokens_per_s": tokens_per_step * len(history) / elapsed if history else 0.0,
        "mfu": [h["mfu"] for h in history],
        "mfu_of_measured_peak": [h["mfu_of_measured_peak"] for h in history],
        "fp8_backend": fp8_backend,  # "emulated": FP8 numerics by quantize/dequantize, GEMMs in fp32
        "fp8": [h["fp8"] for h in history if "fp8" in h],
        "peak_flops": log.peak_flops, "datasheet_peak_flops": log.datasheet_flops,
        "world_size": torch.distributed.get_world_size(),
        # the model's parameters that train (every one, or with LoRA its adapters alone), counted once over the layout
        "trainable_parameters": parameters.trainable(model),
        "device": device.name,
        "checkpoint": str(saved) if saved else None,
        # MoE: per step, each layer's expert shares, aux/z-losses and dropped tokens (moe.RouterStats)
        "router": [{k: h[k] for k in h if k not in _STEP_FIGURES} for h in history] if router else [],
        "memory": probe.gather() if probe else None,  # every rank's bytes held (core.measures.memory_probe)
    }


def _dataset_tokenizer(config: RunConfig) -> Path | None:
    """From scratch: the tokenizer the dataset was prepared with, so checkpoints carry it (inference and
    export need it). Staged once as save_dir/tokenizer (tokenizer files only: the folder's config.json
    describes another model); None when it is gone or changed since the dataset was prepared."""
    ckpt = config.checkpoint
    if config.data.source == "synthetic" or not ckpt.save_dir:
        return None
    describe = sft_data.describe if config.data.source == "sft" else indexed_data.describe
    summary = describe(config.data.paths[0])
    source = Path(summary["tokenizer"])
    if not source.exists() or tokenizer.fingerprint(source) != summary.get("tokenizer_sha256"):
        return None
    staged = Path(ckpt.save_dir) / "tokenizer"
    if worker.rank() == 0:  # the rank that writes checkpoint assets
        tokenizer.copy(source, staged)
    return staged


_STEP_FIGURES = {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "mfu_of_measured_peak", "valid_loss", "valid_loss_at_start"}



