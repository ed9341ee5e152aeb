"""LoRA adapter checkpoints turned into weights, in the conversion worker: merged into the base at a layout
(`merge`), or written as a Hugging Face PEFT adapter (`export_peft`). A library beside `workers.convert`, which runs
them for the `lora_merge` and `lora_peft` directions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint, hf_mapping
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ParallelConfig, PrecisionConfig, RunConfig
from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.launching.job import from_dict
from pai_cookbook.core.modeling import lora


def adapter_run(ckpt: Path) -> tuple[RunConfig, Path]:
    """The run that trained the adapters of `ckpt`, and the base they adapt (its identity checked: the caller refused
    a changed base before launch, `pai_cookbook.lora`)."""
    run = checkpoint.saved_run(ckpt)
    base = checkpoint.read_state(ckpt).get("lora_base")
    if run is None or run.get("lora") is None or base is None:
        raise ValueError(f"{ckpt} holds no LoRA adapters: train with RunConfig(lora=LoRAConfig(...)).")
    return from_dict(RunConfig, run), Path(base["path"])


def _with_adapters(ckpt: Path, parallel: ParallelConfig, device, base_weights: bool):
    """This rank's model at `parallel` with the adapters of `ckpt` loaded; the base's weights loaded too where
    `base_weights` (else built on the meta device: the adapters alone hold memory)."""
    from pai_cookbook.workers.models import build_model

    run, base = adapter_run(ckpt)
    model, dtype = checkpoint.read_config(base)
    precision = PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype])
    if base_weights:
        chunks = build_model(model, parallel, precision, device, run.seed, initialize=False)
        checkpoint.load(chunks, base)
        lora.add_adapters(chunks, run.lora, run.seed)
    else:
        with torch.device("meta"):
            chunks = build_model(model, parallel, precision, device, run.seed, initialize=False)
            lora.add_adapters(chunks, run.lora, run.seed)
        for _, adapter in lora.adapters(chunks):  # real tensors for the adapters alone, filled by the load below
            for name, meta in list(adapter.named_parameters(recurse=False)):
                setattr(adapter, name, torch.nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype)))
    checkpoint.load(chunks, ckpt)  # a model with adapters asks for the adapters alone
    return chunks, run, base, model, dtype


def merge(ckpt: Path, out: Path, parallel: ParallelConfig, device) -> dict[str, Any]:
    """The base of `ckpt` with its adapters folded in (W + alpha/r B A), saved at `parallel` as a full checkpoint."""
    chunks, run, base, model, dtype = _with_adapters(ckpt, parallel, device, base_weights=True)
    merged = lora.merge(chunks)
    saved_at = layout.record(parallel, torch.distributed.get_world_size())
    checkpoint.save(chunks, out, model, dtype, assets=base / checkpoint.HF_ASSETS, merged_from=str(ckpt),
                    base=str(base), saved_at=saved_at)
    return {"merged": merged, "saved_at": saved_at}


def export_peft(ckpt: Path, out: Path, device) -> dict[str, Any]:
    """`ckpt`'s adapters as a Hugging Face PEFT adapter: adapter_model.safetensors (one lora_A and lora_B per Hugging
    Face module: a fused layer's part i is its rows of A, and its B laid out as the fused weight, then split by the
    conversion's own split of that weight) and adapter_config.json, for `peft.PeftModel.from_pretrained` on the
    base's export."""
    from safetensors.torch import save_file

    chunks, run, base, model, _ = _with_adapters(ckpt, ParallelConfig(), device, base_weights=False)
    config: LoRAConfig = run.lora
    tensors, modules = {}, set()
    for name, adapter in lora.adapters(chunks):
        kind, hf_weights = hf_mapping.hf_names(f"{name}.weight", model)
        a = adapter.lora_A.detach().float().split(config.rank)
        b = [getattr(adapter, name).detach().float() for name in adapter.b_names]
        if len(hf_weights) != len(b):
            raise ValueError(f"{name}: {len(b)} adapter parts for {len(hf_weights)} Hugging Face tensors {hf_weights}")
        for i, hf_weight in enumerate(hf_weights):
            alone = adapter.fuse([p.T if j == i else torch.zeros_like(p.T) for j, p in enumerate(b)]).T
            module = hf_weight.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            tensors[f"base_model.model.{module}.lora_A.weight"] = a[i].contiguous().clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = hf_mapping.to_hf(kind, alone, model)[i].contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
        "lora_dropout": config.dropout, "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
        "base_model_name_or_path": str(base), "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return {"tensors": len(tensors), "target_modules": sorted(modules)}
