"""The GPU path on the CPU: Megatron-Core's local spec as a GPU without Transformer Engine builds it
(`PAI_COOKBOOK_LAYERS=local`), every worker under the device guard (`core.machine.device_guard`), which fails where a GPU
would fail on a tensor made on the host and met by the model's.

- the decision itself (`build.choose_layers`) and what a run records (`build.record`);
- no cookbook CPU converter in a model built on that path, and the converters present on the CPU path;
- greedy generation equal to transformers with prompts of different lengths (left-padded: tiny Llama and Qwen2-MoE
  at TP=1 and TP=2; a repetition penalty and seeded sampling ride along) under the guard;
- training at TP=2 equal to TP=1 within 1e-5 under the guard, synthetic pretraining and packed SFT rows;
- a reward model's training and scoring, PPO against it and a GRPO step, under the guard.

MFU against the datasheet (`throughput.datasheet_peak_flops`) is checked here too: it is what a GPU run reports.
"""

import re

import pytest
import torch

from pai_cookbook import extend, generate, hf_baseline, reward_model, rlhf, sft
from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.config import DataConfig, ParallelConfig
from pai_cookbook.core.machine import build, device_guard, runtime
from pai_cookbook.core.measures import throughput
from pai_cookbook.core.modeling.model import training_flops_per_token
from pai_cookbook.generate import GenerationConfig
from tests.conftest import tiny_run

PROMPTS = ["The Python language reference describes", "def f(x): return", "In the beginning",
           "Chinese paragraphs and the interpreter"]
RECORDS = [{"prompt": p, "line": i + 1} for i, p in enumerate(PROMPTS)]
GREEDY = GenerationConfig(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.0, batch_size=4)
PENALISED = GenerationConfig(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.2, batch_size=4)
SAMPLING = GenerationConfig(max_new_tokens=16, ignore_eos=True, top_k=0, top_p=0.9, temperature=0.8, seed=7,
                            batch_size=4)
TP1, TP2 = ParallelConfig(), ParallelConfig(tensor_model_parallel_size=2)
TP2_SP = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)  # an MoE model trains at TP > 1 with SP
CPU_PACKAGE = "pai_cookbook.cpu"


@pytest.fixture(scope="module")
def gpu_path():
    """Every launch of the module on the local layers, under the device guard (the workers inherit both)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.LAYERS_ENV, build.LOCAL_LAYERS)
        patch.setenv(device_guard.ENV, "1")
        yield


def _is_gpu_path_record(record: dict) -> bool:
    return (record["layers"] == build.LOCAL_LAYERS and record["cpu_converters"] == []
            and record["swaps"] == sorted(build.GPU_SWAPS | build.LOCAL_SWAPS)
            and "left_padded_kv_cache" in record["swaps"])


@pytest.mark.parametrize("is_cuda, te, asked, chosen", [
    (False, False, None, build.CPU_LAYERS), (False, False, "auto", build.CPU_LAYERS),
    (False, False, "local", build.LOCAL_LAYERS), (True, False, None, build.LOCAL_LAYERS),
    (True, True, None, build.TE_LAYERS), (True, True, "local", build.LOCAL_LAYERS),
])
def test_one_decision_picks_the_layers(is_cuda, te, asked, chosen):
    environ = {} if asked is None else {build.LAYERS_ENV: asked}
    assert build.choose_layers(is_cuda, te, environ) == chosen


@pytest.mark.parametrize("is_cuda, te, asked, message", [
    (True, False, "local+cpu", "the CPU speed work is for CPUs only"),
    (False, False, "transformer-engine", "needs CUDA and Transformer Engine"),
    (False, False, "fast", "expected one of auto, transformer-engine, local, local+cpu"),
])
def test_layers_a_machine_cannot_build_are_refused(is_cuda, te, asked, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build.choose_layers(is_cuda, te, {build.LAYERS_ENV: asked})


def test_the_record_names_what_each_path_adds():

    device = runtime.detect_device()
    assert device.layers == build.CPU_LAYERS  # this machine's default (no CUDA), unless the environment says
    record = build.record(device)
    assert record["cpu_converters"] == sorted(build.CPU_CONVERTERS) and "fused_cpu_adam" in record["cpu_converters"]
    te = runtime.DeviceInfo(is_cuda=True, name="NVIDIA H100 80GB HBM3", count=1, compute_capability=(9, 0),
                            backend="nccl", has_transformer_engine=True, has_flash_attn=False,
                            layers=build.TE_LAYERS)
    assert build.record(te) == {"layers": build.TE_LAYERS, "swaps": ["seeded_init", "vocab_padding_mask"],
                                "cpu_converters": [], "fused_kernels": sorted(build.FUSED_KERNELS), "grouped_gemm": True}
    assert record["fused_kernels"] == [] and record["grouped_gemm"] is False
    report = runtime.environment_report()["runs_here"]
    assert report["layers"] == "Megatron-Core local + CPU converters" and "fused_cpu_adam" in report["cpu converters"]


@pytest.mark.multiproc
def test_no_cpu_converter_is_built_on_the_local_path(run_scenario, monkeypatch):
    """The local path's model holds Megatron-Core's classes and the named swaps only, for a dense and an MoE
    model, and its worker never imports `pai_cookbook.cpu`; the CPU path's holds the converters (the same checks,
    so they can fail)."""
    for family in ("llama", "qwen2_moe"):
        config = tiny_run(family)
        cpu_path = run_scenario(config, 1, "module_types")
        assert any(m.startswith(CPU_PACKAGE) for m in cpu_path["modules"]), cpu_path
        monkeypatch.setenv(build.LAYERS_ENV, build.LOCAL_LAYERS)
        local = run_scenario(config, 1, "module_types")
        monkeypatch.delenv(build.LAYERS_ENV)
        assert not any(m.startswith(CPU_PACKAGE) for m in local["modules"]), local
        assert cpu_path["cpu_package_imported"] and not local["cpu_package_imported"]  # not even imported
        assert {"SeededTransformerLayer", "LeftPaddedSelfAttention", "SDPAttention", "ColumnParallelLinear",
                "RowParallelLinear"} <= set(local["types"]), local["types"]
        assert _is_gpu_path_record(local["layers"]), local["layers"]
        # ...and the run's log says so first (rank 0's "layers" event, in the log, not echoed into a notebook)
        assert [e["layers"] for e in local["events"] if e["event"] == "layers"] == [build.LOCAL_LAYERS]


GENERATED = ("llama", "qwen2_moe", "deepseek_v3")


@pytest.mark.multiproc
def test_generation_on_the_gpu_path_equals_transformers(converted, gpu_path, tmp_path):
    """Prompts of 3-6 tokens in one left-padded batch, tiny Llama, Qwen2-MoE and DeepSeek-V3 (multi-latent attention,
    right-padded) at TP=1 and TP=2: greedy tokens equal transformers' generate (one prompt at a time); the repetition
    penalty's too; seeded sampling the same at both layouts."""
    jobs = []
    for family in GENERATED:
        ckpt = converted[family][1]
        jobs += [generate.prepare(ckpt, RECORDS, GREEDY, TP1, f"{family} tp1"),
                 generate.prepare(ckpt, RECORDS, GREEDY, TP2, f"{family} tp2")]
    llama = converted["llama"][1]
    jobs += [generate.prepare(llama, RECORDS, PENALISED, TP2, "penalised"),
             generate.prepare(llama, RECORDS, SAMPLING, TP1, "sampling tp1"),
             generate.prepare(llama, RECORDS, SAMPLING, TP2, "sampling tp2")]
    assert len({len(ids) for ids in jobs[0].prompt_ids}) > 1  # the batch is left-padded
    results = dict(zip([j.label for j in jobs], generate.run_jobs(jobs, run_dir=tmp_path, show_progress=False)))
    for family in GENERATED:
        hf = converted[family][2]
        reference = hf_baseline.hf_generate(hf, jobs[0].prompt_ids, GREEDY)["tokens"]
        for tp in (1, 2):
            result = results[f"{family} tp{tp}"]
            assert result["tokens"] == reference, (family, tp)
            assert result["ranks_agree"] and _is_gpu_path_record(result["layers"]), result["layers"]
    penalised = hf_baseline.hf_generate(converted["llama"][2], jobs[0].prompt_ids, PENALISED)["tokens"]
    assert results["penalised"]["tokens"] == penalised
    assert results["sampling tp1"]["tokens"] == results["sampling tp2"]["tokens"]


@pytest.mark.multiproc
def test_training_on_the_gpu_path_tp2_equals_tp1(gpu_path, run_scenario, tmp_path):
    """Three steps of pretraining (synthetic rows) and of SFT on packed rows (block-diagonal masks), each at TP=1
    (two data-parallel replicas) and at TP=2, and of DeepSeek-V3's multi-latent attention and sigmoid router at TP=1 and
    TP=2 with sequence parallelism, under the guard: losses within 1e-5 of each other."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 40, (16,), generator=generator).tolist()
    samples = [sft.Sample(ids=torch.randint(3, 256, (n,), generator=generator).tolist(),
                          loss_mask=[i >= n // 2 for i in range(n)], line=k + 1) for k, n in enumerate(lengths)]
    folder = tmp_path / "sft"
    summary = sft.write(folder, {"train": samples}, 64, pad_id=0, vocab_size=256)
    assert summary["train"]["rows"] < len(samples)  # conversations share rows
    packed = DataConfig(source="sft", paths=[str(folder)], seq_length=64, micro_batch_size=2, global_batch_size=4)
    configs = [tiny_run(train_iters=3, parallel=p) for p in (TP1, TP2)] + \
              [tiny_run(data=packed, train_iters=3, parallel=p) for p in (TP1, TP2)] + \
              [tiny_run("deepseek_v3", train_iters=3, parallel=p) for p in (TP1, TP2_SP)]
    runs = run_scenario.layouts(configs, nproc=2)
    for one, two in (runs[:2], runs[2:4], runs[4:]):
        assert len(one["losses"]) == 3 and max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) <= 1e-5, (
            one["losses"], two["losses"])


@pytest.mark.multiproc
def test_reward_model_ppo_and_grpo_on_the_gpu_path(converted, gpu_path, tmp_path):
    """A reward model trained and evaluated, PPO rolling out and scoring with it (its critic from it), a GRPO step
    with a function's reward and the scoring worker's bits per character, all under the guard; the records say the
    local path computed them."""
    from tests.test_reward_model import PAIRS, VALID

    llama = converted["llama"][1]
    rm = reward_model.train(llama, PAIRS[:32], reward_model.RewardModelConfig(
        steps=2, lr=1e-3, global_batch_size=8, micro_batch_size=4, eval_interval=2, seed=5), valid=VALID[:8],
        save_dir=tmp_path / "rm", run_dir=tmp_path / "rm_run", show_progress=False, echo=False)
    assert _is_gpu_path_record(rm["layers"])
    prompts = [{"prompt": p["prompt"]} for p in VALID[:4]]
    ppo = rlhf.ppo(llama, prompts, rm["checkpoint"], rlhf.PPOConfig(
        steps=1, prompts_per_step=4, group_size=2, max_new_tokens=8, lr=1e-4, micro_batch_size=4, seed=2),
        eval_prompts=prompts[:2], run_dir=tmp_path / "ppo", show_progress=False, echo=False)
    assert len(ppo["steps"]) == 1 and len(ppo["evals"]) == 2 and _is_gpu_path_record(ppo["layers"])
    grpo = rlhf.grpo(llama, PROMPTS, "tests.workers.rewards:brevity", rlhf.GRPOConfig(
        steps=1, prompts_per_step=2, group_size=4, max_new_tokens=8, lr=1e-3, micro_batch_size=4, seed=3),
        run_dir=tmp_path / "grpo", show_progress=False, echo=False)
    assert len(grpo["steps"]) == 1 and grpo["steps"][0]["logprob_diff"] < 1e-4
    assert _is_gpu_path_record(grpo["layers"])
    scored = extend.score([llama], {"english": ["The sea is wide.", "A much longer line of English text."]},
                          run_dir=tmp_path / "score")  # the scoring worker: bits per character
    assert scored["bits_per_char"][str(llama)]["english"] > 0 and _is_gpu_path_record(scored["layers"])


def test_mfu_is_against_the_datasheet_peak():
    """A Llama-3.2-1B-shaped model (bf16, sequence 2,048) at 44,300 tokens/s on one H100 SXM: 364 TFLOP/s of model
    FLOPs, 0.37 of the datasheet's 989 dense bf16 TFLOP/s; a GPU the table lacks, and a CPU, report none."""
    model = families.tiny("llama", hidden_size=2048, num_layers=16, ffn_hidden_size=8192, num_attention_heads=32,
                          num_query_groups=8, kv_channels=64, vocab_size=128256)
    per_token = training_flops_per_token(model, 2048)
    peak = throughput.datasheet_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989e12 and round(44_300 * per_token / 1e12) == 364
    assert round(throughput.model_flops_utilization(44_300, per_token, peak), 2) == 0.37
    assert throughput.datasheet_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12  # the PCIe card, not the SXM row
    assert throughput.datasheet_peak_flops("NVIDIA H20", "fp8") == 296e12
    assert throughput.datasheet_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # no FP8 on an A100
    assert throughput.datasheet_peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    assert throughput.model_flops_utilization(44_300, per_token, None) is None
