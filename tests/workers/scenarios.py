"""Small real runs for the tests, executed under torchrun by `pai_cookbook.launch`.

Job: Scenario(config, scenario, layouts)
  train        train config.train_iters steps with the cookbook's training code, return its history
  rng          draw from the model-parallel RNG tracker and the default generator, twice, on every rank
  param_counts build the model of config.model and count its parameters over all ranks
  layouts      train once per config in `layouts`, rebuilding Megatron-Core's parallel state for each
               inside one process group; returns each history
  recorded_memory per config in `layouts`: its steps with a recording `MemoryProbe`, every rank's bytes held and
               the storages live at the activation peak (tests/test_plan.py reads `layouts`' "memory" instead)
  module_types build the model of config and list the class names of its modules (which layers a device gets)
               and the Python modules that define them, and whether TorchInductor was imported on the way
  packed_logits the same random conversations packed into shared rows and padded one per row: logits per
               conversation, with the block-diagonal mask and (negative control) without it
  grads        per config in `layouts`: one global batch's forward/backward (no optimizer step), its loss
               and every parameter's final gradient (after the DP all-reduce and the per-token scaling)
  token_losses the checkpoint config.checkpoint.load_dir's per-token losses of the first 4 training rows of
               the SFT set config.data.paths[0], packed, with the block-diagonal mask
  attention    the model built twice from one seed, with PyTorch's fused attention and with Megatron-Core's
               unfused one: logits of a causal batch and of packed rows (block-diagonal mask), the loss and
               every parameter's gradient of one backward pass, and each build's core-attention class
  training_ops per config in `layouts` (one seed, TP=1): one forward/backward with the cookbook's training-path
               rotary embedding and SwiGLU (cpu.attention, cpu.glu) and with Megatron-Core's own, and whether the
               losses and every gradient are the same bit for bit; how often each path ran
  adam         per config in `layouts`: three training steps with the optimizer `build` makes and with the same
               optimizer put back on torch's per-tensor loop; whether every Adam group was fused, the largest
               loss and parameter differences between the two; the first run saved after its third step and
               went on two more, and a resume from that save takes the same two steps: their losses, the resumed
               step and the resumed groups' `fused`
  fp8_scales   two forward/backward passes of one batch at the loaded weights, no optimizer step; then each
               FP8 GEMM's delayed-scaling scales, from Transformer Engine or from the emulated backend
The compatibility layer is applied by runtime.init_distributed; PAI_COOKBOOK_COMPAT_SKIP leaves a
patch out, which is how tests/test_compat.py shows each patch is needed.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from pai_cookbook.core.configs.config import RunConfig
from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.job import Job
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.measures.memory_probe import MemoryProbe
from pai_cookbook.workers.models import build_model
from pai_cookbook.workers.training import build, train, train_step

SCENARIOS: dict[str, tuple[Callable[..., dict], str]] = {"train": (train, "config, device")}
"""Every scenario by name (a test names it in `Scenario(scenario=...)`), with what it takes: "config", "config,
device", "layouts, device", or "layouts" (each of `Scenario.layouts` in its own parallel state)."""


def scenario(takes: str) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Register a scenario under its function's name."""
    def register(function: Callable[..., dict]) -> Callable[..., dict]:
        SCENARIOS[function.__name__] = (function, takes)
        return function
    return register


def _gather(t: torch.Tensor) -> list[list[float]]:
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return [o.tolist() for o in out]


@scenario("config")
def rng(config: RunConfig) -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    draws = []
    for _ in range(2):  # the second round re-seeds: reproducibility
        torch.manual_seed(config.seed)
        model_parallel_cuda_manual_seed(config.seed)
        with get_cuda_rng_tracker().fork():
            model_parallel = torch.rand(4)
        default = torch.rand(4)
        draws.append({"model_parallel": _gather(model_parallel), "default": _gather(default)})
    return {"draws": draws}


@scenario("config, device")
def param_counts(config: RunConfig, device) -> dict:
    from megatron.core import parallel_state as ps

    chunks = build_model(config.model, config.parallel, config.precision, device, config.seed)
    # TP-split and expert params are distinct per rank; the rest is replicated over TP: count it once.
    local = 0
    for chunk in chunks:
        for p in chunk.parameters():
            split = getattr(p, "tensor_model_parallel", False) or not getattr(p, "allreduce", True)
            if split or ps.get_tensor_model_parallel_rank() == 0:
                local += p.numel()
    total = torch.tensor([local], dtype=torch.int64)
    torch.distributed.all_reduce(total)
    padded = config.model.padded_vocab_size(config.parallel.tensor_model_parallel_size)
    return {"params": int(total.item()), "padded_vocab_size": padded}


@scenario("config, device")
def module_types(config: RunConfig, device) -> dict:
    import sys

    chunks = build_model(config.model, config.parallel, config.precision, device, config.seed)
    return {"types": sorted({type(m).__name__ for chunk in chunks for m in chunk.modules()}),
            "modules": sorted({type(m).__module__ for chunk in chunks for m in chunk.modules()}),
            "cpu_package_imported": any(name.startswith("pai_cookbook.cpu") for name in sys.modules),
            "compilers_imported": [m for m in ("torch._inductor", "torch._inductor.compile_fx") if m in sys.modules]}


def _random_packed(config: RunConfig, generator: torch.Generator, lengths: list[int]) -> tuple[list, list, dict]:
    """Random conversations of `lengths` ids (each fills len - 1 positions) packed into rows of the config's
    sequence length: (samples, rows, the packed batch with its `document` ids)."""
    from pai_cookbook import sft

    samples = [sft.Sample(ids=torch.randint(1, config.model.vocab_size, (n,), generator=generator).tolist(),
                          loss_mask=[True] * n) for n in lengths]
    rows = sft.pack([n - 1 for n in lengths], config.data.seq_length)
    return samples, rows, sft.batch(samples, rows, config.data.seq_length, pad_id=0)


@scenario("config, device")
def packed_logits(config: RunConfig, device) -> dict:
    from pai_cookbook import sft
    from pai_cookbook.workers.training import model_forward

    generator = torch.Generator().manual_seed(config.seed)
    lengths = [9, 17, 5, 30, 12, 21, 7, 14]
    samples, rows, packed = _random_packed(config, generator, lengths)
    padded = sft.batch(samples, [[i] for i in range(len(samples))], config.data.seq_length, pad_id=0)
    (gpt,) = build_model(config.model, config.parallel, config.precision, device, config.seed)
    gpt.eval()

    thd = device.transformer_engine  # Transformer Engine: THD packed sequences; local spec: the block mask

    def logits(batch):
        with torch.no_grad():
            flat = sft.thd(batch) if thd and "document" in batch else batch
            return model_forward(gpt, flat, labels=False).float().reshape(*batch["tokens"].shape, -1)

    alone = logits(padded)
    diffs = {}
    for name, batch in (("masked", packed), ("unmasked", {k: v for k, v in packed.items() if k != "document"})):
        together = logits(batch)
        diffs[name] = max(float((together[r][packed["document"][r] == d] - alone[i][:lengths[i] - 1]).abs().max())
                          for r, row in enumerate(rows) for d, i in enumerate(row))
    return {"rows": len(rows), "conversations": len(lengths), "thd": thd, "max_abs_diff": diffs["masked"],
            "max_abs_diff_without_boundaries": diffs["unmasked"]}


@scenario("config, device")
def attention(config: RunConfig, device) -> dict:
    import dataclasses

    from pai_cookbook.workers.training import model_forward

    generator = torch.Generator().manual_seed(config.seed)
    tokens = torch.randint(0, config.model.vocab_size, (3, config.data.seq_length), generator=generator)
    causal = {"tokens": tokens, "labels": tokens.roll(-1, 1)}
    _, _, packed = _random_packed(config, generator, [9, 17, 5, 30, 12])
    out = {}
    for backend in ("sdpa", "unfused"):
        model = dataclasses.replace(config.model, attention_backend=backend)
        (gpt,) = build_model(model, config.parallel, config.precision, device, config.seed)
        loss = model_forward(gpt, causal).float().mean()
        loss.backward()
        with torch.no_grad():
            out[backend] = {"causal": model_forward(gpt, causal, labels=False).float(),
                            "packed": model_forward(gpt, packed, labels=False).float(), "loss": float(loss),
                            "grads": torch.cat([p.grad.float().view(-1) for p in gpt.parameters()]),
                            "core_attention": type(gpt.decoder.layers[0].self_attention.core_attention).__name__}
    fused, unfused = out["sdpa"], out["unfused"]
    diff = {key: float((fused[key] - unfused[key]).abs().max()) for key in ("causal", "packed", "grads")}
    return {"max_abs_diff": diff, "loss": [fused["loss"], unfused["loss"]],
            "grad_scale": float(unfused["grads"].abs().max()),
            "core_attention": [fused["core_attention"], unfused["core_attention"]]}


@scenario("layouts, device")
def training_ops(configs: list[RunConfig], device) -> dict:
    import megatron.core.transformer.attention as megatron_attention

    from pai_cookbook.cpu import glu
    from pai_cookbook.workers.training import model_forward

    calls = {"megatron_rotary": 0, "swiglu": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    megatron_attention.apply_rotary_pos_emb = counted("megatron_rotary", megatron_attention.apply_rotary_pos_emb)
    glu.swiglu = counted("swiglu", glu.swiglu)
    out = []
    for config in configs:
        (gpt,) = build_model(config.model, config.parallel, config.precision, device, config.seed)
        generator = torch.Generator().manual_seed(config.seed)
        tokens = torch.randint(0, config.model.vocab_size, (3, config.data.seq_length), generator=generator)
        runs = {}
        for cookbook_ops in (True, False):
            for module in gpt.modules():
                if isinstance(module, glu.GatedMLP):
                    module.plain_swiglu = cookbook_ops
                if hasattr(module, "rotates_unfused"):
                    module.rotates_unfused = cookbook_ops
            gpt.zero_grad(set_to_none=True)
            calls.update(megatron_rotary=0, swiglu=0)
            loss = model_forward(gpt, {"tokens": tokens, "labels": tokens.roll(-1, 1)}).float().mean()
            loss.backward()
            runs[cookbook_ops] = (loss.detach(), [p.grad.clone() for p in gpt.parameters()], dict(calls))
        (loss, grads, ours), (reference_loss, reference_grads, megatrons) = runs[True], runs[False]
        out.append({"family": config.model.family, "dtype": config.precision.dtype,
                    "loss_equal": torch.equal(loss, reference_loss),
                    "grads_equal": all(torch.equal(a, b) for a, b in zip(grads, reference_grads, strict=True)),
                    "max_grad_diff": max(float((a - b).abs().max()) for a, b in zip(grads, reference_grads)),
                    "cookbook_calls": ours, "megatron_calls": megatrons})
    return {"runs": out}


@scenario("config, device")
def token_losses(config: RunConfig, device) -> dict:
    from pai_cookbook import sft
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.workers.training import model_forward

    model, _ = checkpoint.read_config(config.checkpoint.load_dir)
    (gpt,) = build_model(model, config.parallel, config.precision, device, config.seed)
    checkpoint.load([gpt], config.checkpoint.load_dir)
    gpt.eval()
    rows = sft.load(config.data.paths[0], "train")
    picked = rows["document"].amax(1).argsort(descending=True, stable=True)[:4]  # the most conversations per row
    rows = {k: v[picked] for k, v in rows.items()}
    with torch.no_grad():
        losses = model_forward(gpt, sft.thd(rows) if device.transformer_engine else rows).reshape(rows["tokens"].shape)
    return {"rows": picked.tolist(), "losses": losses.float().tolist()}


@scenario("config, device")
def fp8_scales(config: RunConfig, device) -> dict:
    from pai_cookbook.workers.run_state import restore
    from pai_cookbook.workers.training import build, forward_backward, micro_batches

    model, optimizer, scheduler = build(config, device)
    restore(config, model, optimizer, scheduler)
    batch = micro_batches(config, None, 0)[:1]
    for _ in range(2):  # the second pass runs at the scales the first one's amaxes gave (same batch, same amax)
        forward_backward(config, model, batch, forward_only=False)
    scales = {}
    for chunk in model:
        for layer in chunk.module.decoder.layers:
            for name, module in layer.named_modules():
                key = f"{layer.layer_number}.{name}"
                if hasattr(module, "fp8_gemm"):
                    scales[key] = {role: float(state.scale) for role, state in module.fp8_gemm.delayed.items()}
                elif "scaling_fwd" in (getattr(module, "fp8_meta", None) or {}):
                    # Transformer Engine's delayed-scaling state: forward [input, weight, output], backward
                    # [output gradient, input gradient]
                    fwd, bwd = module.fp8_meta["scaling_fwd"].scale, module.fp8_meta["scaling_bwd"].scale
                    scales[key] = {"input": float(fwd[0]), "weight": float(fwd[1]), "grad": float(bwd[0])}
    return {"scales": scales}


@scenario("layouts")
def grads(configs: list[RunConfig]) -> dict:
    from pai_cookbook import sft
    from pai_cookbook.workers.training import build, forward_backward, global_mean_loss, micro_batches

    out = []
    for config, device in zip(configs, runtime.each_layout((c.parallel, c.seed) for c in configs)):
        model, _, _ = build(config, device)
        rows = sft.load(config.data.paths[0], "train")
        loss = global_mean_loss(forward_backward(config, model, micro_batches(config, rows, 0), False,
                                                 device.transformer_engine))
        flat = torch.cat([p.main_grad.detach().float().view(-1) for p in model[0].module.parameters()])
        out.append({"loss": loss, "grads": flat.tolist()})
    return {"runs": out}


@scenario("layouts")
def adam(configs: list[RunConfig]) -> dict:
    from pai_cookbook.core.checkpoints.checkpoint import chained_optimizers
    from pai_cookbook.workers.run_state import restore, save_if_due
    from pai_cookbook.workers.training import build, train_step

    def groups(optimizer):
        return [g for inner in chained_optimizers(optimizer) for g in inner.optimizer.param_groups]

    out = []
    for config, device in zip(configs, runtime.each_layout((c.parallel, c.seed) for c in configs)):
        runs = {}
        for fused in (True, False):
            model, optimizer, scheduler = build(config, device)
            built_fused = [g["fused"] for g in groups(optimizer)]
            if not fused:
                for group in groups(optimizer):
                    group["fused"] = None  # torch's default: the per-tensor loop on CPU
            losses = [train_step(config, model, optimizer, scheduler, step)["loss"] for step in range(3)]
            # what Adam updates: the model's parameters in fp32, the fp32 main copies with bf16, or this rank's shards
            params = [p.detach().clone() for group in groups(optimizer) for p in group["params"]]
            runs[fused] = (built_fused, losses, params)
            if fused:
                save_if_due(config, model, optimizer, scheduler, config.train_iters, None)
                onwards = [train_step(config, model, optimizer, scheduler, step)["loss"] for step in (3, 4)]
        model, optimizer, scheduler = build(config, device)
        for group in groups(optimizer):
            group["fused"] = None  # so that only the restore can set it again
        step, _ = restore(config, model, optimizer, scheduler)
        restored = {"restored_step": step, "restored_fused": [g["fused"] for g in groups(optimizer)],
                    "onwards": onwards,
                    "resumed": [train_step(config, model, optimizer, scheduler, step)["loss"] for step in (3, 4)]}
        (built, losses, params), (_, loop_losses, loop_params) = runs[True], runs[False]
        out.append({"family": config.model.family, "chained": len(chained_optimizers(optimizer)),
                    "dtype": config.precision.dtype, "distributed": config.optimizer.use_distributed_optimizer,
                    "built_fused": built, **restored, "losses": losses,
                    "loss_diff": max(abs(a - b) for a, b in zip(losses, loop_losses)),
                    "param_diff": max(float((a - b).abs().max()) for a, b in zip(params, loop_params)),
                    "params_equal": all(torch.equal(a, b) for a, b in zip(params, loop_params))})
    return {"runs": out}


@scenario("layouts")
def layouts(configs: list[RunConfig]) -> dict:
    devices = runtime.each_layout((c.parallel, c.seed) for c in configs)
    return {"runs": [train(config, device) for config, device in zip(configs, devices)]}


@scenario("layouts")
def recorded_memory(configs: list[RunConfig]) -> dict:
    """Each config stepped by `build` and `train_step` with a recording `MemoryProbe`: every rank's bytes held and the
    storages live at its activation peak (what makes a term of tests/test_plan.py's comparison up)."""
    out = []
    for config, device in zip(configs, runtime.each_layout((c.parallel, c.seed) for c in configs)):
        model, optimizer, scheduler = build(config, device)
        probe = MemoryProbe(record=True)
        for step in range(config.train_iters):
            train_step(config, model, optimizer, scheduler, step, None, probe)
        out.append(probe.gather())
    return {"runs": out}


@dataclass(kw_only=True)
class Scenario(Job):
    WORKER: ClassVar[str] = __file__

    config: RunConfig
    scenario: str = "train"
    layouts: list[RunConfig] = field(default_factory=list)

    def check(self, world_size: int, device) -> None:
        if self.scenario not in SCENARIOS:
            raise ConfigError(f"no scenario {self.scenario!r}; the scenarios are {sorted(SCENARIOS)}.")
        for config in [self.config] + self.layouts:
            config.validate(world_size, device)


@worker.entry(Scenario)
def main(job: Scenario) -> dict:
    function, takes = SCENARIOS[job.scenario]
    if takes == "layouts":
        with worker.session():
            return function(job.layouts)
    with worker.session(job.config.parallel, job.config.seed) as device:
        arguments: dict[str, Any] = {"config": job.config, "device": device, "layouts": job.layouts}
        return function(*(arguments[name] for name in takes.split(", ")))


if __name__ == "__main__":
    main()
