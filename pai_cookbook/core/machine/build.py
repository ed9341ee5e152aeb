"""The build plan: what a run builds on this machine, decided once, by the launcher, and recorded.

Every choice that depends on the hardware is a function of one decided value, the layer path (`choose_layers`, then
narrowed by the job in `core.launching.job.decided`: emulated FP8 builds the local spec's linears), so no module
probes the hardware again (tests/test_architecture.py fails on a new probe):

| path | where | layers | fused kernels, grouped GEMM | what it adds |
|---|---|---|---|---|
| `transformer-engine` | CUDA with TE (the default there) | TE's spec | on (`FUSED_KERNELS`) | `GPU_SWAPS` |
| `local` | CUDA without TE; `PAI_COOKBOOK_LAYERS=local`; emulated FP8 | the local spec | off | and `LOCAL_SWAPS` |
| `local+cpu` | a CPU (the default there) | the local spec | off | and `CPU_CONVERTERS` |

The fused kernels are Transformer Engine's (or Apex's, which TE images carry): Megatron-Core's local linears raise
without Apex's weight-gradient kernel when `gradient_accumulation_fusion` is on, so the local path switches them all
off, on a GPU too. The launcher writes the decided path into job.json (`record`, under "build"); every worker builds
from it, and every result and log carries `record`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

TE_LAYERS, LOCAL_LAYERS, CPU_LAYERS = "transformer-engine", "local", "local+cpu"
LAYER_PATHS = (TE_LAYERS, LOCAL_LAYERS, CPU_LAYERS)
LAYERS_ENV = "PAI_COOKBOOK_LAYERS"
"""Environment variable that picks the layers instead of the default: `local` builds Megatron-Core's local spec as
a GPU without Transformer Engine runs it (on a CPU too, to compare with the CPU speed work); `auto` or unset is the
default. A worker inherits it from its launcher."""

GPU_SWAPS = {
    "seeded_init": "core.modeling.layer_spec.SeededTransformerLayer (and SeededExperts): weights drawn per global layer "
                   "and expert, one model at every TP/PP/EP layout; the forward is TransformerLayer's",
    "vocab_padding_mask": "core.modeling.model.mask_vocab_padding: the output layer's padding rows (Megatron-Core pads "
                          "the vocabulary to a multiple of 128 x TP) filled with the lowest value, so the loss is the "
                          "same at every TP and equals Hugging Face's; no hook where the vocabulary needs no padding",
}
"""What every path adds to upstream's model (none changes what a layer computes)."""
LOCAL_SWAPS = {
    "sdpa_core_attention": "core.modeling.attention.SDPAttention: the core attention on PyTorch's fused kernel (flash or "
                           "memory-efficient on a GPU) instead of materialised scores (ModelConfig.attention_backend)",
    "left_padded_kv_cache": "core.modeling.attention.LeftPaddedSelfAttention: a batch of prompts of different lengths "
                            "left-padded, each row at its own positions, keys rotated once before the static KV cache",
    "latent_attention": "core.modeling.attention.LatentSelfAttention, SplitWidthAttention: multi-latent attention's rotary key "
                        "learns from every TP rank's heads; its values may be narrower than its keys",
}
"""What the local path adds where Transformer Engine is absent: swaps that serve a GPU too."""


CPU_CONVERTERS = {
    "lean_layers": "cpu.lean_layer.LeanTransformerLayer: TransformerLayer's eval forward without the scaffolding of "
                   "features that are off, where no gradient is recorded (bitwise)",
    "lean_attention": "cpu.attention.LeanSelfAttention: Attention.forward likewise at TP=1 in eval (bitwise), and in "
                      "training the rotary embedding applied right after the projection without extra copies (bitwise)",
    "lean_linears": "cpu.linear.LeanColumnParallelLinear / LeanRowParallelLinear (the output layer too): one matmul "
                    "where no gradient is recorded at TP=1 (bitwise)",
    "swiglu_function": "cpu.glu.GatedMLP: SwiGLU as one autograd function, one gradient tensor for fc1 (bitwise)",
    "onednn_decode_packing": "cpu.linear.packed_for_decoding: oneDNN's inner product on weights packed once while "
                             "generating (logits within ~1e-6 relative, greedy tokens equal)",
    "fused_cpu_adam": "cpu.adam.fuse_adam: torch's fused AdamW kernel on CPU parameters (last-bit differences)",
    "glibc_keep_freed_memory": "core.launching.launch.KEEP_FREED_MEMORY: glibc keeps freed memory for the next step in "
                               "workers of repeated steps (no change to values)",
}
"""Every converter of `pai_cookbook.cpu` by name, with what it replaces; `record` lists them in each run's record
(named here, beside the swaps, so that the record needs no import of the CPU package)."""


def choose_layers(is_cuda: bool, has_transformer_engine: bool, environ: Mapping[str, str] | None = None) -> str:
    """The one decision of which layers a run builds (see the module): Transformer Engine's spec on CUDA with TE,
    Megatron-Core's local spec on CUDA without it, the local spec plus `pai_cookbook.cpu`'s converters on a CPU;
    `PAI_COOKBOOK_LAYERS=local` asks for the local spec anywhere.

    Raises:
        ValueError: an unknown value, or one this machine cannot build (local+cpu on CUDA, TE without TE or CUDA).
    """
    env = os.environ if environ is None else environ
    asked = env.get(LAYERS_ENV, "auto").strip() or "auto"
    default = (TE_LAYERS if has_transformer_engine else LOCAL_LAYERS) if is_cuda else CPU_LAYERS
    if asked == "auto":
        return default
    if asked not in LAYER_PATHS:
        raise ValueError(f"{LAYERS_ENV}={asked!r}: expected one of auto, {', '.join(LAYER_PATHS)}; unset it for the "
                         f"default here ({default}).")
    if asked == CPU_LAYERS and is_cuda:
        raise ValueError(f"{LAYERS_ENV}={CPU_LAYERS} on a CUDA machine: the CPU speed work is for CPUs only. Use "
                         f"{LOCAL_LAYERS} or unset it ({default}).")
    if asked == TE_LAYERS and not (is_cuda and has_transformer_engine):
        raise ValueError(f"{LAYERS_ENV}={TE_LAYERS} needs CUDA and Transformer Engine, which this machine lacks; "
                         f"unset it ({default}).")
    return asked


def record(device: Any) -> dict[str, Any]:
    """What a run on `device` (a `runtime.DeviceInfo`, its layers decided) builds, for the environment report, every
    result and the first line of every log: the layer path, what it adds to upstream's model (`GPU_SWAPS`,
    `LOCAL_SWAPS`), the CPU converters (`CPU_CONVERTERS`; none off the CPU path), the fused kernels switched on
    (`FUSED_KERNELS`; Transformer Engine's path only) and whether MoE experts run as one grouped GEMM by default."""
    swaps = dict(GPU_SWAPS) | (LOCAL_SWAPS if device.layers != TE_LAYERS else {})
    converters = CPU_CONVERTERS if device.cpu_converters else {}
    return {"layers": device.layers, "swaps": sorted(swaps), "cpu_converters": sorted(converters),
            "fused_kernels": sorted(FUSED_KERNELS) if fused_kernels(device.layers) else [],
            "grouped_gemm": grouped_gemm(device.layers)}


FUSED_KERNELS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
                 "masked_softmax_fusion", "moe_permute_fusion", "persist_layer_norm")
"""Megatron-Core's fused-kernel switches (`TransformerConfig` fields), all on where Transformer Engine builds the
layers (`bias_activation_fusion` for SwiGLU only, `moe_permute_fusion` for MoE only), all off elsewhere."""


def fused_kernels(layers: str) -> bool:
    """Whether `FUSED_KERNELS` are on for the layer path `layers`: Transformer Engine's only."""
    return layers == TE_LAYERS


def grouped_gemm(layers: str) -> bool:
    """Whether MoE experts run as one grouped GEMM where the model does not say (`ModelConfig.moe_grouped_gemm`):
    on Transformer Engine's path; elsewhere Megatron-Core's SequentialMLP, a loop of ordinary matmuls computing the
    same function."""
    return layers == TE_LAYERS


# Ada (sm_89) and Hopper (sm_90) are the first architectures with FP8 tensor cores; MXFP8 needs Blackwell.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
MXFP8_MIN_COMPUTE_CAPABILITY = (10, 0)


def fp8_backend(device: Any, recipe: str, asked: str, wgrad: bool) -> str:
    """FP8's backend on `device` (a `runtime.DeviceInfo`, its layers chosen): 'te' where Transformer Engine builds the
    layers on a GPU of compute capability >= 8.9 (Ada, Hopper; Blackwell for mxfp8), else 'emulated'
    (`core.modeling.fp8`: FP8 rounding and range, GEMMs in fp32). `asked`: `FP8Config.backend` ('auto', 'te',
    'emulated'). Raises ConfigError for a request that cannot run here, naming what is missing."""
    from pai_cookbook.core.configs.model_config import require

    cap = device.compute_capability or (0, 0)
    te_layers = device.layers == TE_LAYERS
    missing = ("" if device.layers == TE_LAYERS or not device.is_cuda else
               f" with {device.layers} layers ({LAYERS_ENV}={LOCAL_LAYERS} builds no Transformer Engine layers)"
               if device.has_transformer_engine else " without Transformer Engine (pip install -e '.[gpu]')")
    if recipe == "mxfp8":
        require(te_layers and cap >= MXFP8_MIN_COMPUTE_CAPABILITY,
                f"recipe='mxfp8' needs Blackwell (compute capability >= 10.0) with Transformer Engine; found "
                f"{device.name}{missing}; the emulated backend covers delayed, tensorwise and blockwise.")
        return "te"
    te_ok = te_layers and cap >= FP8_MIN_COMPUTE_CAPABILITY
    if asked == "te" or (asked == "auto" and te_ok):
        require(te_ok, f"backend='te' needs Transformer Engine on a GPU of compute capability >= 8.9 (Ada, Hopper); "
                       f"found {device.name}{missing}; use backend='emulated' (FP8 numerics emulated, GEMMs in fp32) "
                       f"or 'auto'.")
        return "te"
    require(wgrad, "wgrad=False (a higher-precision weight-gradient GEMM) needs backend='te'; the emulated "
                   "backend quantizes every GEMM of the linear layer; set wgrad=True.")
    return "emulated"


def without_te(layers: str) -> str:
    """The local spec where the machine's path `layers` is Transformer Engine's, the others as they are: what a job
    whose modules wrap or replace Megatron-Core's local linears builds (emulated FP8's quantizing linears, LoRA's
    adapters), so that on a Transformer Engine GPU it builds the local path, and says so."""
    return LOCAL_LAYERS if layers == TE_LAYERS else layers
