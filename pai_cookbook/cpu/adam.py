"""torch's fused AdamW kernel for Megatron-Core's Adam on CPU parameters
(`core.machine.build.CPU_CONVERTERS["fused_cpu_adam"]`)."""

from __future__ import annotations

import torch

from pai_cookbook.core.checkpoints import checkpoint

FUSED_MARK = "cookbook_fused_cpu_adam"
"""Attribute set on a Megatron-Core optimizer `fuse_adam` converted: a checkpoint's load is converted again."""


def fuse_adam(optimizer) -> None:
    """Make Megatron-Core's Adam on CPU tensors torch's fused AdamW kernel rather than its per-tensor loop.

    Without Transformer Engine or Apex, `get_megatron_optimizer` builds `torch.optim.AdamW` with torch's default
    implementation, which for CPU tensors is a Python loop of about ten ATen ops a tensor, each a pass over it (torch
    defaults to its fused kernels on accelerators only). With them, on GPU, Megatron-Core steps with TE's or Apex's
    fused Adam. torch's fused kernel does the same update in one pass (docs/megatron-core-on-cpu.md has the step
    before and after). Its arithmetic is the loop's in another order, so parameters differ in the last bits, as TE's
    fused Adam differs from both. Applied to every group of every torch Adam under `optimizer` (chained, mixed
    precision or distributed) whose parameters are on CPU; again after a checkpoint's load (`workers.run_state`, where
    the optimizer carries `FUSED_MARK`), whose saved groups carry their own `fused`.
    """
    for inner in checkpoint.chained_optimizers(optimizer):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):  # AdamW is one; TE's and Apex's FusedAdam are not
            continue
        for group in adam.param_groups:
            if all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"]) \
                    and not group["differentiable"]:
                group["fused"], group["foreach"] = True, False
    setattr(optimizer, FUSED_MARK, True)

