"""Pretraining worker: Megatron DDP + Megatron optimizer + Megatron's pipeline schedules.

The steps are those of Megatron-LM's `run_simple_mcore_train_loop.py`, each a function here:
`build` (model provider, DDP, optimizer, LR schedule), `forward_step`, `train_step`; saving is
`checkpoint.save`. The worker
entry (`main`) reads the config, joins the process group, trains, and always tears down.

From a notebook: `run(config, nproc_per_node=2)` checks what can be checked on this machine,
launches the workers and returns the per-step losses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from pai_cookbook import launch as launcher
from pai_cookbook import checkpoint, data, moe, runtime, worker
from pai_cookbook.config import ConfigError, RunConfig
from pai_cookbook.model import build_model, torch_dtype, training_flops_per_token
from pai_cookbook.runtime import DeviceInfo



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


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # clone: the schedule divides `loss` in place by the number of micro-batches after this returns.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """One micro-batch forward; returns per-token losses and the function that reduces them."""
    device = next(model.parameters()).device
    batch = next(data_iterator)
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, attention_mask=None, labels=labels)
    return output, partial(_loss_func, batch["loss_mask"].to(device))


def build(config: RunConfig, device: DeviceInfo):
    """Model chunks wrapped in Megatron DDP, the Megatron optimizer and the LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = config.optimizer
    chunks = build_model(config.model, config.parallel, config.precision, device, config.seed, config.memory)
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
    )
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model, optimizer, scheduler


def _global_mean_loss(reports: list[dict[str, torch.Tensor]]) -> float:
    """Mean LM loss of the whole global batch, available on every rank.

    Losses exist on the last pipeline stage only; each DP replica's TP-rank-0 contributes its mean / DP
    and one all-reduce over the world adds them up.
    """
    from megatron.core import parallel_state as ps

    value = torch.zeros(1, dtype=torch.float64)
    if reports and ps.get_tensor_model_parallel_rank() == 0:
        mean = torch.stack([r["lm loss"].double().cpu() for r in reports]).mean()
        value += mean / ps.get_data_parallel_world_size()
    if torch.cuda.is_available():
        value = value.cuda()
    torch.distributed.all_reduce(value)
    return float(value.item())


def micro_batches(config: RunConfig, dataset: Any, step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of global batch `step`, from the dataset or the synthetic source."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if dataset is None:
        return synthetic_batches(config, step, dp_rank, dp_size)
    return data.global_batch(dataset, step, config.data.global_batch_size, config.data.micro_batch_size,
                             dp_rank, dp_size)


def _forward_backward(config: RunConfig, model, batches: list[dict[str, torch.Tensor]], forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    # One iterator per model chunk: with virtual pipeline each chunk consumes the same micro-batches.
    iterators = [iter(batches) for _ in model]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(batches),
        seq_length=config.data.seq_length,
        micro_batch_size=config.data.micro_batch_size,
        decoder_seq_length=config.data.seq_length,
        forward_only=forward_only,
    )


def evaluate(config: RunConfig, model, dataset: Any) -> float:
    """Mean validation loss over config.eval_iters global batches (forward only)."""
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        losses = [_global_mean_loss(_forward_backward(config, model, micro_batches(config, dataset, i), True))
                  for i in range(config.eval_iters)]
    for chunk in model:
        chunk.train()
    return sum(losses) / len(losses)


def train_step(config: RunConfig, model, optimizer, scheduler, step: int, dataset: Any = None) -> dict[str, float]:
    """One optimizer step over the global batch (gradient accumulation over micro-batches)."""
    batches = micro_batches(config, dataset, step)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = _forward_backward(config, model, batches, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    lr = optimizer.param_groups[0]["lr"]
    scheduler.step(increment=1)
    return {"loss": _global_mean_loss(reports), "grad_norm": float(grad_norm or 0.0), "lr": float(lr)}




class StepLog:
    """Per-step figures: tokens/s and MFU on every step, written by rank 0 to run_dir/metrics.jsonl and
    to TensorBoard (run_dir/tensorboard) when the launcher gave a run folder."""

    def __init__(self, config: RunConfig, device: DeviceInfo):
        self.tokens_per_step = config.data.global_batch_size * config.data.seq_length
        self.flops_per_token = training_flops_per_token(config.model, config.data.seq_length)
        # The world's peak: every rank measures its own device (and threads), then they are summed.
        peak = torch.tensor([runtime.measure_matmul_peak(torch_dtype(config.precision))], dtype=torch.float64)
        torch.distributed.all_reduce(peak.cuda() if device.is_cuda else peak)
        self.peak_flops = float(peak.item())
        self.jsonl = self.tensorboard = None
        run_dir = os.environ.get(worker.RUN_DIR_ENV)
        if run_dir and worker.rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.jsonl = (Path(run_dir) / "metrics.jsonl").open("a")
            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def throughput(self, seconds: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / seconds
        return {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * self.flops_per_token / self.peak_flops}

    def write(self, step: int, figures: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps({"step": step} | figures) + "\n")
        self.jsonl.flush()
        for name, value in figures.items():
            if not isinstance(value, (int, float)):  # per-layer router lists stay in metrics.jsonl
                continue
            self.tensorboard.add_scalar(f"train/{name}" if name != "valid_loss" else "valid/loss", value, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.tensorboard.close()


def _layout(config: RunConfig, world_size: int) -> dict[str, int]:
    """The layout a training checkpoint records, and that a resume must match."""
    p = config.parallel
    return {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size or 1, "ep": p.expert_model_parallel_size,
            "world": world_size}


def _restore(config: RunConfig, model, optimizer, scheduler) -> tuple[int, str | None]:
    """Resume from save_dir's latest checkpoint, or start from load_dir's weights; returns (step, source)."""
    ckpt = config.checkpoint
    modules = [m.module for m in model]
    latest = checkpoint.finished_iterations(ckpt.save_dir)[-1:] if ckpt.save_dir and ckpt.resume else []
    if latest:
        return checkpoint.load_training(modules, optimizer, scheduler, latest[0]), str(latest[0])
    if ckpt.load_dir:
        checkpoint.load(modules, ckpt.load_dir)
        optimizer.reload_model_params()  # bf16: refresh the fp32 master copies from the loaded weights
        return 0, ckpt.load_dir
    return 0, None


def train(config: RunConfig, device: DeviceInfo) -> dict[str, Any]:
    """Run (or continue) training up to config.train_iters; returns this invocation's history."""
    model, optimizer, scheduler = build(config, device)
    first_step, started_from = _restore(config, model, optimizer, scheduler)
    train_set = valid_set = None
    if config.data.source == "indexed":
        train_set, valid_set = data.build_datasets(config, config.eval_iters)
    ckpt, dtype = config.checkpoint, torch_dtype(config.precision)
    assets = Path(ckpt.load_dir) / checkpoint.HF_ASSETS if ckpt.load_dir else _dataset_tokenizer(config)
    tokens_per_step = config.data.global_batch_size * config.data.seq_length
    history: list[dict[str, float]] = []
    valid_losses: list[tuple[int, float]] = []
    saved = None
    log = StepLog(config, device)
    router = moe.RouterStats([m.module for m in model], config) if config.model.is_moe else None
    start = time.perf_counter()
    for step in range(first_step, config.train_iters):
        step_start = time.perf_counter()
        history.append(train_step(config, model, optimizer, scheduler, step, train_set))
        history[-1] |= log.throughput(time.perf_counter() - step_start)
        if router is not None:
            history[-1] |= router.step()
        done = step + 1
        last = done == config.train_iters
        if valid_set is not None and config.eval_interval and (done % config.eval_interval == 0 or last):
            valid_losses.append((done, evaluate(config, model, valid_set)))
            history[-1]["valid_loss"] = valid_losses[-1][1]
        if ckpt.save_dir and (last or (ckpt.save_interval and done % ckpt.save_interval == 0)):
            saved = checkpoint.save_training([m.module for m in model], optimizer, scheduler, done, ckpt.save_dir,
                                             config.model, dtype, _layout(config, torch.distributed.get_world_size()), keep_last=ckpt.keep_last,
                                             assets=assets)
        log.write(done, history[-1])
        if worker.rank() == 0 and (done % config.log_interval == 0 or last):
            shown = ("loss", "lr", "tokens_per_s") + (("min_load", "max_load") if router else ())
            worker.progress(done, config.train_iters, **{k: history[-1][k] for k in shown})
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
        "peak_flops": log.peak_flops,
        "world_size": torch.distributed.get_world_size(),
        "device": device.name,
        "checkpoint": str(saved) if saved else None,
        # MoE: per step, each layer's expert shares, aux/z-losses and dropped tokens (moe.RouterStats)
        "router": [{k: h[k] for k in h if k not in _STEP_FIGURES} for h in history] if router else [],
    }


def _dataset_tokenizer(config: RunConfig) -> Path | None:
    """From scratch: the tokenizer the dataset was prepared with, so checkpoints carry it (inference and
    export need it). Staged once as save_dir/tokenizer (tokenizer files only: the folder's config.json
    describes another model); None when it is gone or changed since the dataset was prepared."""
    ckpt = config.checkpoint
    if config.data.source != "indexed" or not ckpt.save_dir:
        return None
    summary = data.describe(config.data.paths[0])
    source = Path(summary["tokenizer"])
    if not source.exists() or data.tokenizer_fingerprint(source) != summary.get("tokenizer_sha256"):
        return None
    staged = Path(ckpt.save_dir) / "tokenizer"
    if worker.rank() == 0:  # the rank that writes checkpoint assets
        checkpoint.copy_assets(source, staged, checkpoint.TOKENIZER_ASSET_FILES)
    return staged


def preflight(config: RunConfig, world_size: int) -> None:
    """Checks that need this machine's filesystem, done before any worker starts.

    Raises:
        ConfigError / DataError / FileExistsError: naming the problem and the fix.
    """
    ckpt, parallel = config.checkpoint, config.parallel
    if config.model.is_moe and parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        # Megatron-Core's MoE layer raises this in the first training forward (inference is fine without SP).
        raise ConfigError(f"training an MoE model at TP={parallel.tensor_model_parallel_size} needs "
                          f"sequence_parallel=True (each TP rank routes its own slice of the sequence).")
    if config.data.source == "indexed":
        data.check_for_training(config)
    if ckpt.load_dir:
        loaded, _ = checkpoint.read_config(ckpt.load_dir)
        differ = [f.name for f in dataclasses.fields(loaded)
                  if getattr(loaded, f.name) != getattr(config.model, f.name) and f.name not in _TRAINING_ONLY]
        if differ:
            raise ConfigError(f"checkpoint.load_dir {ckpt.load_dir} holds a model that differs from config.model in "
                              f"{differ}; build config.model with checkpoint.read_config(load_dir)[0].")
    if not ckpt.save_dir:
        return
    latest = checkpoint.finished_iterations(ckpt.save_dir)[-1:]
    if latest and ckpt.resume:
        layout, wanted = checkpoint.saved_layout(latest[0]) or {}, _layout(config, world_size)
        if layout != wanted:
            raise ConfigError(f"cannot resume {latest[0]}: it was saved at {layout}, this run is {wanted}. Resume "
                              f"at the saved layout, or start a new run from it with checkpoint.load_dir (weights "
                              f"only; Megatron-Core reshards them) and another save_dir.")
        return
    if ckpt.overwrite:
        shutil.rmtree(ckpt.save_dir, ignore_errors=True)
        return
    checkpoint.check_writable(ckpt.save_dir, False, "checkpoint.overwrite=True (or resume=True)")


_STEP_FIGURES = {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "valid_loss"}

# ModelConfig fields that shape training but not the weights: a checkpoint may be trained on with others.
_TRAINING_ONLY = {"hidden_dropout", "attention_dropout", "init_method_std", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                  "moe_router_load_balancing_type", "moe_token_dispatcher_type", "moe_grouped_gemm",
                  "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"}


def run(config: RunConfig, *, nproc_per_node: int = 1, run_dir: str | Path = "runs/train",
        **launch_kwargs: Any) -> dict[str, Any]:
    """Train under torchrun from a notebook or script; returns rank 0's result (losses, tokens/s)."""
    preflight(config, runtime.detect_launch_env().world_size(nproc_per_node))
    return launcher.launch("pai_cookbook.train", config, nproc_per_node=nproc_per_node, run_dir=run_dir,
                           **launch_kwargs)


@worker.entry
def main(config_path: str) -> dict[str, Any]:
    config = RunConfig.load(config_path)
    device = runtime.init_distributed(config.parallel, config.seed)
    try:
        return train(config, device)
    finally:
        runtime.destroy_distributed()


if __name__ == "__main__":
    main()
