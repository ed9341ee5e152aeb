"""Megatron-Core on a machine without CUDA: the cookbook's one compatibility layer, per Megatron-Core release.

Megatron-Core assumes CUDA in a handful of places. On a CPU-only machine each of them fails (or, in
one case, silently computes the wrong loss). `apply()` patches around each of them, once per
process, before any model is built; where CUDA is present it does nothing. Megatron-Core's own files
are never edited: every patch rebinds a name from outside, in the spirit of Pai-Megatron-Patch.

Each patch is a named entry of `PATCHES` with the symptom it removes and the Megatron-Core releases it applies to
(`versions`): a patch upstream made unnecessary is retired for the releases after it, and one a release needs anew
names the releases from it. `tests/test_compat.py` runs a small real scenario per patch with that patch skipped
(PAI_COOKBOOK_COMPAT_SKIP=name) on whichever release is installed, and shows it fails on every release the patch
claims; CI runs it on both ends of `core.machine.versions.MEGATRON_CORE`. docs/megatron-core-on-cpu.md has, per release,
what is patched and why.

What is *not* patched, because it is a choice rather than a bug: grouped GEMM for experts needs
CUDA, so `core.modeling.model` picks Megatron-Core's SequentialMLP (a per-expert loop of matmuls, the
same function) on CPU; the flex token dispatcher needs DeepEP and is rejected by config validation.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pai_cookbook.core.machine import megatron_import, standins, versions

EVERY_RELEASE = versions.MEGATRON_CORE
SKIP_ENV = "PAI_COOKBOOK_COMPAT_SKIP"
"""Comma-separated patch names to leave out: a diagnostic switch used by the tests."""

_applied: list[str] | None = None


@dataclass(frozen=True)
class Patch:
    name: str
    symptom: str
    """What happens on a CPU-only machine without this patch."""
    apply: Callable[[], None]
    versions: SpecifierSet = EVERY_RELEASE
    """The Megatron-Core releases that need it (shown by its test failing without it on each)."""

    def applies_to(self, version: Version | str) -> bool:
        return self.versions.contains(Version(str(version)), prereleases=True)


def _rebind(module: types.ModuleType, name: str, new: Any) -> None:
    """Replace `module.name`, and every `from module import name` copy inside megatron.*."""
    old = getattr(module, name)
    setattr(module, name, new)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("megatron.") and mod is not module and getattr(mod, name, None) is old:
            setattr(mod, name, new)


# --- 1. torch.cuda.current_device() used as a device --------------------------------------------
def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


# --- 1b. .cuda() calls ------------------------------------------------------------------------------
def _patch_cuda_method() -> None:
    """`tensor.cuda()` / `module.cuda()` stay on the CPU, the only device there is.

    Seen in the tied-embedding set-up with PP > 1 (language_module: `weight.data = weight.data.cuda()`
    before the first/last-stage all-reduce); without CUDA the call can only fail.
    """
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


# --- 2. literal device="cuda" in module code ------------------------------------------------------
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint")
# Megatron-Core modules that create tensors with a literal device="cuda" on the CPU training path.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)


def _patch_cuda_literals() -> None:
    import importlib

    cpu_torch = standins.CpuTorch(_FACTORIES)
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = cpu_torch


# --- 3. the model-parallel RNG tracker ------------------------------------------------------------
def _patch_rng_tracker() -> None:
    """Map the CUDA RNG API onto the CPU generator, so seeds really take effect.

    On a CPU machine every random op (weight init, dropout) draws from the CPU default generator, so
    that is the generator the tracker must fork: `add(name, seed)` captures the CPU state seeded with
    `seed`, `fork(name)` swaps it in and out. TP ranks then get distinct, reproducible streams.
    Without this, torch.cuda.manual_seed is queued lazily and never runs.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(*args, **kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, *args, **kwargs) -> None:
        torch.set_rng_state(new_state)

    def seed(value: int) -> None:
        # The generator itself, not torch.manual_seed: that one calls torch.cuda.manual_seed_all.
        torch.default_generator.manual_seed(int(value))

    for namespace in (torch.cuda, torch.cuda.random):
        namespace.get_rng_state = get_state
        namespace.set_rng_state = set_state
        namespace.manual_seed = seed
        namespace.manual_seed_all = seed
    _rebind(mrandom, "_get_cuda_rng_state", get_state)
    _rebind(mrandom, "_set_cuda_rng_state", set_state)


# --- 4. streams, events and synchronize ---------------------------------------------------------
def _patch_streams() -> None:
    torch.cuda.Stream = standins.NullStream
    torch.cuda.Event = standins.CpuEvent
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = standins.NullStream
    torch.cuda.default_stream = standins.NullStream
    torch.cuda.stream = standins.NullStream


# --- 5. optimizers that identify fp32 params by CUDA type name ------------------------------------
def _patch_type_names() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    cls = optimizer.Float16OptimizerWithFloat16Params
    cls.__init__ = standins.with_cuda_type_names(cls.__init__)
    dist = distrib_optimizer.DistributedOptimizer
    build = dist._build_model_and_main_param_groups.__func__
    dist._build_model_and_main_param_groups = classmethod(standins.with_cuda_type_names(build))
    _rebind(clip_grads, "clip_grad_by_total_norm_fp32",
            standins.with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32))


# --- 6. MoE router GEMM references a TE symbol that is missing without TE -------------------------
def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # the router then takes its torch matmul path


# --- 7. alltoall token dispatcher passes split sizes as tensors -----------------------------------
def _patch_alltoall_split_sizes() -> None:
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward

    def as_list(sizes):
        return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes

    def forward_with_lists(ctx, group, input, output_split_sizes, input_split_sizes, *rest):
        # gloo's all_to_all_single takes Python lists of sizes (NCCL tolerates tensors). `rest`: 0.18 on adds
        # `use_nccl_stream`.
        return forward(ctx, group, input, as_list(output_split_sizes), as_list(input_split_sizes), *rest)

    mappings._AllToAll.forward = staticmethod(forward_with_lists)


# --- 8. torch norms refuse sequence parallelism ----------------------------------------------------
def _patch_torch_norm_sequence_parallel() -> None:
    """Let the local spec's norms run under sequence parallelism, with correct gradients.

    A norm's weight is replicated over the TP group while each rank sees a different slice of the
    sequence, so its gradient must be summed over TP. Megatron-Core does that for parameters marked
    `sequence_parallel = True`, which is what TE's norms do and what this patch does.
    """
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False  # lift the assert for the duration of the build only
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


# --- 9. selective recompute reaches for Transformer Engine names -----------------------------------
def _patch_recompute_without_te() -> None:
    """CheckpointWithoutOutput (selective recompute of layernorm/mlp/moe_act) uses three TE names.

    `fp8 is not None` is True for fp8=False, so it always asks TE's FP8 state; without TE the names
    are undefined. Stand-ins: FP8 is off, and TE's recompute/autocast contexts do nothing.
    """
    from megatron.core.tensor_parallel import random as mrandom

    stand_ins = {
        "FP8GlobalStateManager": standins.NoFP8,
        "activation_recompute_forward": lambda *args, **kwargs: contextlib.nullcontext(),
        "fp8_autocast": lambda *args, **kwargs: contextlib.nullcontext(),
    }
    for name, value in stand_ins.items():
        if not hasattr(mrandom, name):
            setattr(mrandom, name, value)


# --- 10. batched p2p on gloo: silently wrong interleaved-pipeline loss -----------------------------
def _patch_gloo_p2p() -> None:
    """Send pipeline activations with individual isend/irecv on gloo.

    Measured: virtual pipeline (interleaved) with batched isend/irecv over gloo raises nothing and
    gives a different loss from PP=1 (5.5695 vs 5.5665); unbatched ops match to 6 decimals.
    """
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    batched, single = p2p._batched_p2p_ops, p2p._p2p_ops

    def p2p_ops(*, group, **kwargs):
        if torch.distributed.get_backend(group) == "gloo":
            # The batched caller collects requests in a list; the unbatched ops return them by name.
            return list(single(group=group, **kwargs).values())
        return batched(group=group, **kwargs)

    p2p._batched_p2p_ops = p2p_ops


# --- 11. uneven all-gather / reduce-scatter on gloo ------------------------------------------------
def _patch_gloo_uneven_collectives() -> None:
    """Gather and reduce-scatter pieces of different lengths over gloo, as NCCL does.

    With expert-TP > 1 and EP > 1 the alltoall dispatcher gathers each TP rank's routed tokens (a
    different count per rank) with `all_gather` into unequal pieces; gloo accepts equal pieces only
    ("invalid tensor size"). Gather: pad every piece to the longest, gather, trim. Reduce-scatter (its
    backward): all-reduce the whole tensor and keep this rank's piece: the same sums, more traffic.
    """
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def on_gloo(group, sizes) -> bool:
        return sizes is not None and group.size() > 1 and torch.distributed.get_backend(group) == "gloo"

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not on_gloo(group, output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not on_gloo(group, input_split_sizes):
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return total.split([int(n) for n in input_split_sizes])[group.rank()].contiguous()

    _rebind(mappings, "_gather_along_first_dim", gather_uneven)
    _rebind(mappings, "_reduce_scatter_along_first_dim", reduce_scatter_uneven)


# --- 12. pipeline-parallel inference asserts CUDA tensors -------------------------------------------
def _patch_inference_pipeline_tensors() -> None:
    """Let inference pass CPU tensors between pipeline stages.

    `inference/communication_utils` asserts `tensor.is_cuda` before broadcasting the last stage's
    logits and before each stage's send/receive; the broadcast and p2p themselves work over gloo.
    """
    from megatron.core.inference import communication_utils

    def is_tensor(tensor) -> None:
        assert tensor is not None

    communication_utils._is_cuda = is_tensor


# --- 13. Mamba-2's kernels come from mamba_ssm, which needs CUDA ---------------------------------------------------
def _patch_mamba_kernels() -> None:
    """Mamba-2 mixers on `core.machine.ssm`'s PyTorch kernels: `ssm/mamba_mixer` takes its scan and gated norm from
    `mamba_ssm` (CUDA only) and refuses to build without it; its decode kernels are Triton's (None: PyTorch's)."""
    from megatron.core.ssm import mamba_mixer

    from pai_cookbook.core.machine import ssm

    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.mamba_chunk_scan_combined = ssm.chunk_scan
    mamba_mixer.mamba_split_conv1d_scan_combined = ssm.split_conv1d_scan
    mamba_mixer.RMSNormGated = mamba_mixer.ExtendedRMSNorm = ssm.GatedRMSNorm
    mamba_mixer.causal_conv1d_update = mamba_mixer.selective_state_update = None


def _patch_gdn_kernels() -> None:
    """Gated DeltaNet layers on PyTorch: `ssm/gated_delta_net` takes its convolution, l2norm and delta rule from `fla`
    (Triton) and refuses to build without it; Megatron-Core's own PyTorch delta rule and `core.machine.ssm`'s others."""
    from megatron.core.ssm.gated_delta_net import common, gdn  # noqa: F401 - gdn's copies of the names are rebound

    from pai_cookbook.core.machine import ssm

    common.HAVE_FLA = True
    for name, kernel in (("l2norm", ssm.l2norm), ("causal_conv1d", ssm.fla_causal_conv1d),
                         ("chunk_gated_delta_rule", common.torch_chunk_gated_delta_rule)):
        _rebind(common, name, kernel)


PATCHES: tuple[Patch, ...] = (
    Patch("current_device", "AssertionError: Torch not compiled with CUDA enabled (rotary embedding, layers)",
          _patch_current_device),
    Patch("cuda_method", "AssertionError: Torch not compiled with CUDA enabled at a .cuda() call (tied "
          "embeddings with PP > 1)", _patch_cuda_method),
    Patch("cuda_literals", "CUDA init error from device='cuda' literals in schedules, optimizer, clip_grads, "
          "masks", _patch_cuda_literals),
    Patch("rng_tracker", "'cuda rng state model-parallel-rng is not added'; seeds never reach a generator",
          _patch_rng_tracker),
    Patch("streams", "AttributeError / CUDA init errors from torch.cuda.Stream/Event/synchronize",
          _patch_streams),
    Patch("cuda_type_names", "optimizer asserts param.type() == 'torch.cuda.FloatTensor'",
          _patch_type_names),
    Patch("te_general_gemm", "NameError: te_general_gemm in the MoE router without Transformer Engine",
          _patch_te_general_gemm, SpecifierSet("<0.17")),  # 0.17 binds it to None without TE
    Patch("alltoall_split_sizes", "TypeError in all_to_all_single: gloo wants split sizes as lists",
          _patch_alltoall_split_sizes),
    Patch("torch_norm_sequence_parallel", "AssertionError: sequence parallel not supported by torch LayerNorm",
          _patch_torch_norm_sequence_parallel),
    Patch("recompute_without_te", "NameError: FP8GlobalStateManager / activation_recompute_forward in "
          "selective recompute without TE", _patch_recompute_without_te),
    Patch("gloo_p2p", "no error, silently wrong loss with interleaved pipeline and batched p2p on gloo",
          _patch_gloo_p2p),
    Patch("inference_pipeline_tensors", "AssertionError at `assert tensor.is_cuda` in inference/communication_utils "
          "(generation with PP > 1)", _patch_inference_pipeline_tensors),
    Patch("gloo_uneven_collectives", "RuntimeError: ProcessGroupGloo::allgather: invalid tensor size (MoE with "
          "EP > 1 and expert-TP > 1)", _patch_gloo_uneven_collectives),
    # hybrid models are built from Megatron-Core 0.19 on (core.modeling.hybrid)
    Patch("mamba_kernels", "ImportError: MambaSSM is not installed (a hybrid model's Mamba-2 layers)",
          _patch_mamba_kernels, SpecifierSet(">=0.19")),
    Patch("gdn_kernels", "ImportError: FLA is not installed (a hybrid model's gated DeltaNet layers)", _patch_gdn_kernels,
          SpecifierSet(">=0.19")),
)


def needed(version: Version | str | None = None) -> tuple[Patch, ...]:
    """The patches the given Megatron-Core release (by default the installed one) needs, in the order applied."""
    version = version if version is not None else versions.megatron_core_version()
    return tuple(p for p in PATCHES if p.applies_to(version))


def apply(skip: tuple[str, ...] | None = None) -> list[str]:
    """Apply every patch once per process; a no-op (returns []) when CUDA is available.

    Args:
        skip: patch names to leave out; defaults to the PAI_COOKBOOK_COMPAT_SKIP variable.
    Returns:
        The names of the patches applied in this process (those the installed Megatron-Core needs, `needed()`).
    """
    global _applied
    if _applied is not None:
        return _applied
    if torch.cuda.is_available():
        _applied = []
        return _applied
    megatron_import.without_inductor()  # the release was checked when pai_cookbook was imported (core.machine.versions)
    if skip is None:
        skip = tuple(s for s in os.environ.get(SKIP_ENV, "").split(",") if s)
    unknown = set(skip) - {p.name for p in PATCHES}
    if unknown:
        raise ValueError(f"unknown compat patch(es) {sorted(unknown)}; known: {[p.name for p in PATCHES]}")
    _applied = []
    for patch in needed():
        if patch.name not in skip:
            patch.apply()
            _applied.append(patch.name)
    return _applied
