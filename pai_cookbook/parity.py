"""Does the Megatron-Core model compute what the Hugging Face model computes? Measured, not printed.

`check(hf_dir, ckpt, parallel)` loads the converted checkpoint at a TP/PP/EP layout in torchrun workers
(with Megatron-Core's own `dist_checkpointing.load`), runs a fixed batch of real text through it, and
compares fp32 logits with `AutoModelForCausalLM` on the same batch: cosine similarity, max and mean
absolute difference, argmax agreement, and each side's next-token loss on the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs import layout
from pai_cookbook.core.configs.config import ParallelConfig, PrecisionConfig
from pai_cookbook.core.launching.jobs import ParityJob
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.measures.logit_parity import DEFAULT_BATCH, DEFAULT_SEQ, compare_logits, token_batch

__all__ = ["DEFAULT_BATCH", "DEFAULT_SEQ", "ParityJob", "check", "check_layouts", "compare_logits", "token_batch"]


def check(hf_dir: str | Path, ckpt: str | Path, parallel: ParallelConfig | None = None, *,
          run_dir: str | Path = "runs/parity", batch: int = DEFAULT_BATCH, seq: int = DEFAULT_SEQ,
          precision: PrecisionConfig | None = None) -> dict[str, Any]:
    """Parity of the checkpoint `ckpt` loaded at layout `parallel` against the HF model in `hf_dir`."""
    return check_layouts(hf_dir, ckpt, [parallel or ParallelConfig()], run_dir=run_dir, batch=batch, seq=seq,
                         precision=precision)[0]


def check_layouts(hf_dir: str | Path, ckpt: str | Path, layouts: list[ParallelConfig], *,
                  run_dir: str | Path = "runs/parity", batch: int = DEFAULT_BATCH,
                  seq: int = DEFAULT_SEQ, precision: PrecisionConfig | None = None,
                  logits_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Parity at several layouts in one torchrun launch: Megatron-Core's parallel state is rebuilt per
    layout inside one process group, and the Hugging Face logits are computed once.

    `precision` is the Megatron-Core side's (default fp32); the reference is always transformers in fp32,
    and in a lower precision the rows also carry transformers' own error in it (`hf_low_precision_max_abs_diff`),
    the yardstick for the Megatron-Core error.

    Runs the smallest world that holds every layout (the lcm of `layout.world_size`); every layout is
    checked against the model and that world before anything starts. With `logits_dir` each row also names the file
    that holds its logits ("logits_file": fp32 safetensors, key "logits"), to compare two runs directly (two
    Megatron-Core releases: tests/test_versions.py).
    """
    import math

    from pai_cookbook.core.launching import launch

    ckpt = checkpoint.resolve(ckpt)
    model, _ = checkpoint.read_config(ckpt)
    world = math.lcm(*(layout.world_size(p) for p in layouts))
    for parallel in layouts:
        layout.check(model, parallel, world, purpose="load", device=runtime.detect_device())
    job = ParityJob(hf_dir=str(hf_dir), ckpt=str(ckpt), layouts=list(layouts), batch=batch, seq=seq,
                    precision=precision or PrecisionConfig(), logits_dir=str(logits_dir) if logits_dir else None)
    result = launch.launch(job, nproc_per_node=world, run_dir=run_dir, echo=False, show_progress=False)
    return [row | {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
                   "ep": p.expert_model_parallel_size, "processes": world}
            for row, p in zip(result["rows"], layouts)]
