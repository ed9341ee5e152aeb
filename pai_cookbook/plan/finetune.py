"""Fine-tuning on the GPUs a PAI-DSW instance rents: full fine-tuning against LoRA for one model on one or two GPUs of
each type, each answered with the fastest layout that fits (or the smallest that does not), in what the GPU can run.

A GPU without bf16 (V100, T4) is planned in fp32, and on the local spec where it cannot run Transformer Engine's
layers; LoRA runs the local spec everywhere (its adapters wrap the local linears). What each GPU cannot do is said
beside it (`hardware.GPU.limits`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.model_config import ModelConfig
from pai_cookbook.core.machine.build import LOCAL_LAYERS, TE_LAYERS
from pai_cookbook.plan import hardware, search
from pai_cookbook.plan.hardware import GIB, Cluster
from pai_cookbook.plan.layouts import Workload

DSW_GPUS = ("A10-24GB", "L20-48GB", "V100-32GB", "T4-16GB", "A100-80GB", "H100-80GB")
"""What PAI-DSW users rent, the small cards first."""


def plans(model: ModelConfig, gpus: Sequence[str] = DSW_GPUS, counts: Sequence[int] = (1, 2), *,
          seq_length: int = 4096, global_batch_size: int = 8,
          lora: LoRAConfig = LoRAConfig(rank=16, alpha=32.0)) -> list[dict]:
    """One row per GPU type, GPU count and way of training: {"GPU", "GPUs", "training", "precision", "layers",
    "layout" (the fastest that fits, or the one needing least memory), "GiB per GPU", "fits", "tokens/s"}."""
    rows = []
    for name in gpus:
        gpu = hardware.gpu(name)
        dtype = "bf16" if gpu.bf16 else "fp32"
        for count in counts:
            cluster = Cluster(gpu=gpu, gpus_per_node=count, nodes=1)
            for training, adapters in (("full fine-tuning", None), (f"LoRA rank {lora.rank}", lora)):
                layers = TE_LAYERS if gpu.transformer_engine and adapters is None else LOCAL_LAYERS
                workload = Workload(seq_length=seq_length, global_batch_size=global_batch_size, dtype=dtype,
                                    lora=adapters, layers=layers)
                options = [o for o in search.plan(model, cluster, workload) if o.layout.cp == 1]
                fitting = [o for o in options if o.fits]
                best = fitting[0] if fitting else min(options, key=lambda o: o.memory.total)
                rows.append({"GPU": gpu.name, "GPUs": count, "training": training, "precision": dtype,
                             "layers": layers, "layout": best.layout.describe(),
                             "GiB per GPU": best.memory.total / GIB, "fits": "yes" if best.fits else "no",
                             "tokens/s": best.time.tokens_per_s if best.fits else None})
    return rows


def limits(gpus: Sequence[str] = DSW_GPUS) -> list[dict]:
    """What each GPU can and cannot do: {"GPU", "memory GiB", "bf16", "Transformer Engine", "limits"}."""
    return [{"GPU": g.name, "memory GiB": g.memory_gib, "bf16": "yes" if g.bf16 else "no",
             "Transformer Engine": "yes" if g.transformer_engine else "no", "limits": g.limits or "none"}
            for g in map(hardware.gpu, gpus)]
