"""Each CPU compatibility patch is needed (skip it: the scenario fails) and sufficient (apply it:
the scenario runs and matches a reference). Real Megatron-Core runs under torchrun, gloo backend."""

import re

import pytest
import torch

from pai_cookbook.core.configs.config import MemoryConfig, ParallelConfig, PrecisionConfig
from pai_cookbook.core.launching.launch import WorkerError
from pai_cookbook.core.machine import compat, versions
from tests.conftest import tiny_run

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the compatibility layer is a no-op on CUDA")]

TP2 = ParallelConfig(tensor_model_parallel_size=2)
TP2_SP = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
EP2 = ParallelConfig(expert_model_parallel_size=2)
SELECTIVE = MemoryConfig(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])

# patch -> (config, processes, scenario, what the failing rank's log shows without the patch). Where torch's
# CPU build and its CUDA build on a machine without a GPU (a CUDA wheel on a laptop) fail differently, both.
BREAKS_WITHOUT = {
    "current_device": (tiny_run(), 1, "train", r"current_device\(\)"),
    "cuda_literals": (tiny_run(), 1, "train", r"device=[\"']cuda[\"']"),
    "cuda_method": (tiny_run("qwen2", parallel=ParallelConfig(pipeline_model_parallel_size=2)), 2, "train",
                    r"weight\.data\.cuda\(\)"),
    "rng_tracker": (tiny_run(parallel=TP2), 2, "rng", r"Torch not compiled with CUDA|Found no NVIDIA driver"),
    "streams": (tiny_run("mixtral"), 1, "train", r"torch\.cuda\.Stream requires CUDA|CUDA driver version is insufficient"),
    "cuda_type_names": (tiny_run(precision=PrecisionConfig(dtype="bf16")), 1, "train", r"torch\.cuda\.FloatTensor"),
    "te_general_gemm": (tiny_run("mixtral"), 1, "train", r"name 'te_general_gemm' is not defined"),
    "alltoall_split_sizes": (tiny_run("mixtral", parallel=EP2), 2, "train", r"all_to_all_single"),
    "torch_norm_sequence_parallel": (tiny_run(parallel=TP2_SP), 2, "train",
                                     r"sequence parallel not supported by torch"),
    "recompute_without_te": (tiny_run(memory=SELECTIVE), 1, "train", r"name 'FP8GlobalStateManager' is not defined"),
    # sufficient: tests/test_moe.py trains this layout to the single-process losses
    "gloo_uneven_collectives": (tiny_run("mixtral", parallel=ParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
        expert_tensor_parallel_size=2)), 4, "train", r"ProcessGroupGloo::allgather: invalid tensor size"),
    # sufficient: tests/test_convert.py's Nemotron-H logits equal transformers', tests/test_train.py trains it
    "mamba_kernels": (tiny_run("nemotron_h"), 1, "train", r"MambaSSM is not installed"),
    # sufficient: tests/test_convert.py's Qwen3-Next logits equal transformers', tests/test_train.py trains it
    "gdn_kernels": (tiny_run("qwen3_next"), 1, "train", r"FLA is not installed"),
}
# Patches for what a later release builds first (hybrid models from 0.19): not needed below it, and not retired there.
ARRIVED = {"mamba_kernels": "0.19", "gdn_kernels": "0.19"}


INSTALLED = versions.megatron_core_version()
NEEDED = {p.name for p in compat.needed()}


@pytest.mark.both_ends  # the second tier runs what each patch claims on 0.16 too (ci/test.sh)
def test_every_patch_has_a_test():
    # gloo_p2p: below; inference_pipeline_tensors: tests/test_generate.py (generation at PP=2)
    assert set(BREAKS_WITHOUT) | {"gloo_p2p", "inference_pipeline_tensors"} == {p.name for p in compat.PATCHES}


@pytest.mark.both_ends
@pytest.mark.parametrize("patch", sorted(BREAKS_WITHOUT))
def test_patch_is_needed(patch, run_scenario):
    """On the installed release, each patch it claims is needed: its scenario fails without it. CI runs this file
    on both ends of the supported range (ci/test.sh), so every claim is checked on 0.16 and on 0.19."""
    if patch in ARRIVED and patch not in NEEDED:
        pytest.skip(f"{patch} is needed from megatron-core {ARRIVED[patch]} on, which first builds what it patches")
    if patch not in NEEDED:
        pytest.skip(f"{patch} is retired on megatron-core {INSTALLED} (test_retired_patches_are_not_needed)")
    config, nproc, scenario, symptom = BREAKS_WITHOUT[patch]
    with pytest.raises(WorkerError) as err:
        run_scenario(config, nproc, scenario, skip=patch)
    assert re.search(symptom, err.value.log_tail), err.value.log_tail


def _losses(run_scenario, config, nproc=1, skip=""):
    return run_scenario(config, nproc, skip=skip)["losses"]


@pytest.mark.parametrize("patch", ["current_device", "cuda_literals", "cuda_type_names", "recompute_without_te",
                                   "cuda_method"])
def test_single_process_paths_train(patch, run_scenario):
    # With every patch applied the scenario trains; its first loss is ln(256) = 5.545 +- 0.05 at init.
    config, nproc, scenario, _ = BREAKS_WITHOUT[patch]
    losses = _losses(run_scenario, config, nproc)
    assert len(losses) == config.train_iters and abs(losses[0] - 5.545) < 0.05


def test_rng_tracker_streams_are_seeded_distinct_and_reproducible(run_scenario):
    config, nproc, scenario, _ = BREAKS_WITHOUT["rng_tracker"]
    first, second = run_scenario(config, nproc, scenario)["draws"]
    tp0, tp1 = first["model_parallel"]
    assert tp0 != tp1, "TP ranks must draw different dropout masks inside the model-parallel region"
    assert first["default"][0] == first["default"][1], "outside it, ranks share the data-parallel stream"
    assert first == second, "re-seeding must reproduce every stream exactly"


def test_sequence_parallel_matches_tensor_parallel(run_scenario):
    # The norm weights' grads must be summed over TP under SP; a wrong sum shows from step 2 on.
    config = BREAKS_WITHOUT["torch_norm_sequence_parallel"][0]
    sp = _losses(run_scenario, config, 2)
    tp = _losses(run_scenario, tiny_run(parallel=TP2), 2)
    assert sp == pytest.approx(tp, abs=1e-5)


def test_moe_alltoall_with_expert_parallelism_trains(run_scenario):
    config = BREAKS_WITHOUT["alltoall_split_sizes"][0]
    losses = _losses(run_scenario, config, 2)
    assert len(losses) == 2 and all(abs(x - 5.545) < 0.05 for x in losses)


@pytest.mark.both_ends
def test_gloo_p2p_interleaved_pipeline_matches_single_process(run_scenario):
    # The silent one: without the patch nothing raises, the loss is just wrong.
    four_layers = {"num_layers": 4}
    vpp = tiny_run(model_overrides=four_layers, parallel=ParallelConfig(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2))
    reference = _losses(run_scenario, tiny_run(model_overrides=four_layers))
    assert _losses(run_scenario, vpp, 2) == pytest.approx(reference, abs=1e-5)
    wrong = _losses(run_scenario, vpp, 2, skip="gloo_p2p")
    assert max(abs(a - b) for a, b in zip(wrong, reference)) > 1e-4


def test_a_cpu_worker_builds_its_model_without_importing_torchinductor(run_scenario):
    """Megatron-Core's fusions wrap themselves in torch.compile at import, which imports TorchInductor (1.6 s
    of every CPU worker's start); the layer imports Megatron-Core with torch.compile as the identity."""
    figures = run_scenario(tiny_run(), 1, "module_types")
    assert "GPTModel" in figures["types"] and "SDPAttention" in figures["types"], figures["types"]
    assert figures["compilers_imported"] == []


def test_apply_is_idempotent_and_rejects_unknown_names():
    import subprocess
    import sys
    code = ("from pai_cookbook.core.machine import compat; a = compat.apply(); b = compat.apply(); "
            "assert a is b and a == [p.name for p in compat.needed()], a; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
    bad = subprocess.run([sys.executable, "-c", "from pai_cookbook.core.machine import compat; compat.apply(skip=('nope',))"],
                         capture_output=True, text=True)
    assert "unknown compat patch" in bad.stderr


def test_cuda_event_keeps_time_on_cpu():
    # The static inference controller divides event.elapsed_time(...) by 1e3 for per-token latencies;
    # a stand-in that returns a non-number breaks every generation at the end of its batch.
    import subprocess
    import sys
    code = ("import time, torch; from pai_cookbook.core.machine import compat; compat.apply(); "
            "a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); "
            "a.record(); time.sleep(0.05); b.record(); b.synchronize(); print(a.elapsed_time(b))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert 50.0 <= float(out.stdout) < 5000.0  # milliseconds, like CUDA's elapsed_time


@pytest.mark.both_ends
@pytest.mark.parametrize("patch", sorted(set(BREAKS_WITHOUT) - NEEDED - set(ARRIVED)) or [None])
def test_retired_patches_are_not_needed(patch, run_scenario):
    """A patch upstream made unnecessary is not applied on the releases after the fix, and its scenario runs there."""
    if patch is None:
        pytest.skip(f"megatron-core {INSTALLED} needs every patch")
    config, nproc, scenario, _ = BREAKS_WITHOUT[patch]
    losses = run_scenario(config, nproc, scenario)["losses"]  # the patch is not applied (NEEDED), and it trains
    assert len(losses) == config.train_iters and abs(losses[0] - 5.545) < 0.05


@pytest.mark.both_ends
def test_patch_versions_cover_the_two_ends():
    # te_general_gemm: 0.17 binds the name to None without Transformer Engine (moe_utils); mamba_kernels, gdn_kernels:
    # hybrid models are built from 0.19 on (ARRIVED); every other patch is needed on both ends (test_patch_is_needed)
    assert {p.name for p in compat.needed("0.16.1")} == {p.name for p in compat.PATCHES} - set(ARRIVED)
    assert {p.name for p in compat.PATCHES} - {p.name for p in compat.needed("0.19.2")} == {"te_general_gemm"}


def test_a_megatron_core_outside_the_range_is_refused():
    versions.check("0.16.1", "2.13.0")
    versions.check("0.19.2", "2.11.0a0+6c3e8d5.nv26.02")  # NGC's pre-release build of the torch floor
    for bad in ("0.15.3", "0.20.0"):
        with pytest.raises(RuntimeError, match=rf"megatron-core {bad} is installed, but the cookbook is tested on "
                                               r"megatron-core<0\.20,>=0\.16\.1\. Install a version inside"):
            versions.check(bad, "2.13.0")
    with pytest.raises(RuntimeError, match=r"torch 2.5.1 is installed"):
        versions.check("0.19.2", "2.5.1")
