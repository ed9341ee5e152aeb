"""Importing Megatron-Core on a machine without CUDA without TorchInductor: a start-up cost, not a CUDA assumption
(so not one of `core.machine.compat`'s patches), paid by every worker and by a notebook that prepares data.

`megatron.core.jit` binds `jit_fuser = torch.compile`, and a dozen small functions (bias-GELU/GeGLU/SwiGLU fusions, a
router's expert bias, a norm) are decorated with it as their modules import; wrapping a function in torch.compile
imports TorchInductor. The cookbook turns the fusions off without CUDA (`core.modeling.model.transformer_config`), and where
one of the others runs on a CPU it runs as the plain PyTorch function it wraps. The import times are in
docs/megatron-core-on-cpu.md.
"""

from __future__ import annotations

import sys

import torch


def without_inductor() -> None:
    """Import Megatron-Core with `torch.compile` standing in as the identity while it loads (CPU only); nothing when
    megatron.core is already imported."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile

    def identity(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        import megatron.core  # noqa: F401  (imports megatron.core.jit and the fusions under the identity)
    finally:
        torch.compile = compile_


def import_megatron_core() -> None:
    """Import Megatron-Core as the workers do, in the caller's own process (a notebook kernel: `data.prepare`'s
    dataset builder): without TorchInductor where there is no CUDA; no patch applied."""
    if not torch.cuda.is_available():
        without_inductor()
