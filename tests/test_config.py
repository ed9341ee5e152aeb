"""Config validation: bad layouts are rejected before launch, each with a message naming value and fix."""

import dataclasses

import pytest

from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.config import (
    ConfigError,
    DataConfig,
    FP8Config,
    MemoryConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
)
from pai_cookbook.core.machine import build, runtime

CPU = runtime.DeviceInfo(is_cuda=False, name="CPU", count=0, compute_capability=None, backend="gloo",
                         has_transformer_engine=False, has_flash_attn=False)
A100 = dataclasses.replace(CPU, is_cuda=True, name="A100", count=8, compute_capability=(8, 0), backend="nccl",
                           has_transformer_engine=True, layers=build.TE_LAYERS)
H100 = dataclasses.replace(A100, name="H100", compute_capability=(9, 0))
DATA = DataConfig(seq_length=32, micro_batch_size=2, global_batch_size=8)


def run(family="llama", model=None, **fields):
    fields.setdefault("data", DATA)
    return RunConfig(model=model or families.tiny(family), **fields)


# (what is wrong, how to build it, world size, device, the message that must name it)
BAD_LAYOUTS = [
    ("heads not divisible by TP", lambda: run(parallel=ParallelConfig(tensor_model_parallel_size=8)), 8, CPU,
     # only the TPs every check takes: 4 divides the heads but not the 2 KV groups (it was suggested, then refused)
     r"num_attention_heads 4 is not divisible by TP=8.*Use TP in \[1, 2\]\."),
    ("query groups not divisible by TP", lambda: run(parallel=ParallelConfig(tensor_model_parallel_size=4)), 4, CPU,
     r"num_query_groups 2 is not divisible by TP=4.*Use TP in \[1, 2\]\."),
    ("layers not divisible by PP", lambda: run(model=families.tiny(num_layers=3),
                                               parallel=ParallelConfig(pipeline_model_parallel_size=2)), 2, CPU,
     r"num_layers 3 is not divisible by PP x virtual PP = 2 x 1"),
    ("layers not divisible by PP x VPP", lambda: run(
        model=families.tiny(num_layers=4), data=DataConfig(seq_length=32, micro_batch_size=1, global_batch_size=8),
        parallel=ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4)), 2, CPU,
     r"num_layers 4 is not divisible by PP x virtual PP = 2 x 4"),
    ("experts not divisible by EP", lambda: run("mixtral", parallel=ParallelConfig(expert_model_parallel_size=3)),
     3, CPU, r"num_experts 4 is not divisible by EP=3"),
    ("world size not a multiple of TP x PP", lambda: run(parallel=ParallelConfig(tensor_model_parallel_size=2)),
     3, CPU, r"world size 3 is not divisible by TP x PP = 2 x 1"),
    ("global batch not divisible by micro x DP", lambda: run(
        data=DataConfig(seq_length=32, micro_batch_size=3, global_batch_size=8)), 2, CPU,
     r"global_batch_size 8 is not divisible by micro_batch_size x DP = 3 x 2"),
    ("interleaved micro-batches not divisible by PP", lambda: run(
        model=families.tiny(num_layers=4), data=DataConfig(seq_length=32, micro_batch_size=2, global_batch_size=2),
        parallel=ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)), 2, CPU,
     r"interleaved schedule needs micro-batches per step \(1\) divisible by PP=2"),
    ("TE FP8 on CPU", lambda: run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(backend="te"))), 1, CPU,
     r"backend='te' needs Transformer Engine on a GPU of compute capability >= 8.9.*found CPU.*backend='emulated'"),
    ("TE FP8 on Ampere", lambda: run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(backend="te"))), 1, A100,
     r"compute capability >= 8.9 \(Ada, Hopper\); found A100"),
    ("TE FP8 without TE", lambda: run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(backend="te"))), 1,
     dataclasses.replace(H100, has_transformer_engine=False, layers=build.LOCAL_LAYERS),
     r"found H100 without Transformer Engine"),
    ("MXFP8 on Hopper", lambda: run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(recipe="mxfp8"))), 1,
     H100, r"recipe='mxfp8' needs Blackwell \(compute capability >= 10.0\)"),
    ("MXFP8 on CPU", lambda: run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(recipe="mxfp8"))), 1,
     CPU, r"recipe='mxfp8' needs Blackwell.*emulated backend covers delayed, tensorwise and blockwise"),
    ("first/last layers bf16 leaving no FP8 layer", lambda: run(precision=PrecisionConfig(
        dtype="bf16", fp8=FP8Config(recipe="tensorwise", first_last_layers_bf16=True))), 1, CPU,
     r"keeps 2 of the model's 2 layers in BF16: none would run in FP8"),
    ("emulated FP8 without FP8 wgrad", lambda: run(precision=PrecisionConfig(
        dtype="bf16", fp8=FP8Config(wgrad=False))), 1, CPU, r"wgrad=False .* needs backend='te'"),
    ("fp16 on CPU", lambda: run(precision=PrecisionConfig(dtype="fp16")), 1, CPU, r"dtype='fp16' needs a GPU"),
    ("fp32 SFT rows on Transformer Engine", lambda: run(data=DataConfig(source="sft", paths=["set"], seq_length=32)), 1,
     H100, r"THD\) attention, which has no fp32 kernel; use PrecisionConfig\(dtype='bf16'\)"),
    ("flex dispatcher on CPU", lambda: run(model=families.tiny("mixtral", moe_token_dispatcher_type="flex")),
     1, CPU, r"'flex' needs DeepEP"),
    ("grouped GEMM forced on CPU", lambda: run(model=families.tiny("mixtral", moe_grouped_gemm=True)), 1, CPU,
     r"moe_grouped_gemm=True needs CUDA"),
    ("EP on a dense model", lambda: run(parallel=ParallelConfig(expert_model_parallel_size=2)), 2, CPU,
     r"expert_model_parallel_size 2 is set for a dense model"),
    ("training at EP=1 with expert-TP != TP (Megatron-Core gives wrong expert grads)", lambda: run(
        "mixtral", parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                           expert_tensor_parallel_size=1)), 2, CPU,
     r"expert_tensor_parallel_size 1 != tensor_model_parallel_size 2 with expert_model_parallel_size 1"),
    ("experts with biases at expert-TP 2", lambda: run(
        "gpt_oss", parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                           expert_model_parallel_size=2)), 2, CPU,
     r"gpt_oss: experts with biases are built by Megatron-Core at expert_tensor_parallel_size 1 only, got 2"),
    ("expert layout over world size", lambda: run("mixtral", parallel=ParallelConfig(
        expert_model_parallel_size=2, tensor_model_parallel_size=2, expert_tensor_parallel_size=2)), 2, CPU,
     r"world size 2 is not divisible by EP x expert-TP x PP = 2 x 2 x 1"),
]

# Rejected when the config object is built (no world size needed).
BAD_FIELDS = [
    ("sequence parallel without TP", lambda: ParallelConfig(sequence_parallel=True),
     r"sequence_parallel=True needs tensor_model_parallel_size > 1"),
    ("virtual PP without PP", lambda: ParallelConfig(virtual_pipeline_model_parallel_size=2),
     r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
    ("context beyond rotary wavelength", lambda: families.tiny(max_position_embeddings=100_000),
     r"max_position_embeddings 100000 exceeds rotary's longest wavelength .* = 62832 tokens"),
    ("sequence longer than the model's context", lambda: run(data=DataConfig(seq_length=512)),
     r"seq_length 512 exceeds the model's max_position_embeddings 256"),
    ("YaRN on part of each head outside multi-latent attention", lambda: families.tiny(
        "qwen3", rotary_percent=0.5, yarn={"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}),
     r"yarn with rotary_percent 0.5: GPTModel's YaRN rotary turns whole heads"),
    ("attention sinks with attention dropout", lambda: families.tiny("gpt_oss", attention_dropout=0.1),
     r"attention_dropout 0.1 with attention sinks: the cookbook's sink attention has no dropout"),
    ("top-k above expert count", lambda: families.tiny("mixtral", moe_router_topk=5),
     r"moe_router_topk 5 exceeds num_experts 4"),
    ("sinkhorn with top-2", lambda: families.tiny("mixtral", moe_router_load_balancing_type="sinkhorn"),
     r"sinkhorn load balancing supports top-1 routing only"),
    ("sinkhorn with an aux loss", lambda: families.tiny("mixtral", moe_router_topk=1,
                                                        moe_router_load_balancing_type="sinkhorn"),
     r"sinkhorn balances by assignment and refuses an aux loss; set moe_aux_loss_coeff=0 \(got 0.001\)"),
    ("experts in no layer", lambda: families.tiny("deepseek_v3", moe_layer_freq=[0, 0]),
     r"num_experts 16 with no MoE layer \(moe_layer_freq \[0, 0\]\)"),
    ("expert bias with softmax scores", lambda: families.tiny("mixtral", moe_router_enable_expert_bias=True),
     r"moe_router_enable_expert_bias=True needs moe_router_score_function='sigmoid'"),
    ("capacity factor with sinkhorn", lambda: families.tiny(
        "mixtral", moe_router_topk=1, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=1.0),
     r"moe_expert_capacity_factor 1.0 must be > 0 .* not sinkhorn"),
    ("padding to capacity without a capacity", lambda: families.tiny(
        "mixtral", moe_pad_expert_input_to_capacity=True), r"pads to a capacity; set moe_expert_capacity_factor"),
    ("query groups not dividing heads", lambda: families.tiny(num_query_groups=3),
     r"num_attention_heads 4 is not divisible by num_query_groups 3"),
    ("min_lr above lr", lambda: OptimizerConfig(lr=1e-4, min_lr=1e-3),
     r"min_lr 0.001 must lie in \[0, lr=0.0001\]"),
    ("fp8 with fp16", lambda: PrecisionConfig(dtype="fp16", fp8=FP8Config()), r"set dtype='bf16'"),
    ("fp8 as a string", lambda: PrecisionConfig(dtype="bf16", fp8="delayed"), r"fp8 must be an FP8Config"),
    ("first/last layers bf16 with delayed scaling", lambda: FP8Config(first_last_layers_bf16=True),
     r"first_last_layers_bf16 cannot be combined with delayed scaling"),
    ("negative fp8 margin", lambda: FP8Config(margin=-1), r"margin -1 must lie in \[0, 1023\]"),
    # found failing in the worker (an OverflowError, a 4 GB history per operand) or reporting FP8 with no FP8 layer
    ("fp8 margin past a float", lambda: FP8Config(margin=1100), r"margin 1100 must lie in \[0, 1023\].*overflows"),
    ("fp8 amax history of 4 GB", lambda: FP8Config(amax_history_len=10**9),
     r"amax_history_len 1000000000 keeps .*3,815 MiB each.*at most 8192"),
    ("negative bf16 layer counts", lambda: FP8Config(recipe="tensorwise", first_last_layers_bf16=True,
                                                     num_layers_at_start_in_bf16=-1),
     r"num_layers_at_start_in_bf16 -1 .* must be >= 0"),
    ("warmup as long as the run", lambda: run(train_iters=2, optimizer=OptimizerConfig(lr_warmup_iters=2)),
     r"lr_warmup_iters 2 must be below train_iters 2"),
    ("unknown recompute module", lambda: MemoryConfig(recompute_modules=["attention"]),
     r"recompute_modules \['attention'\] are not among"),
]


@pytest.mark.parametrize("case", BAD_LAYOUTS, ids=[c[0] for c in BAD_LAYOUTS])
def test_bad_layout_rejected_with_specific_message(case):
    _, build, world_size, device, message = case
    with pytest.raises(ConfigError, match=message):
        build().validate(world_size, device)


@pytest.mark.parametrize("case", BAD_FIELDS, ids=[c[0] for c in BAD_FIELDS])
def test_bad_field_rejected_when_built(case):
    _, build, message = case
    with pytest.raises(ConfigError, match=message):
        build()


def test_good_layouts_pass():
    run().validate(1, CPU)
    run(parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)).validate(2, CPU)
    run("mixtral", parallel=ParallelConfig(expert_model_parallel_size=2)).validate(2, CPU)
    run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config())).validate(1, H100)
    run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config())).validate(1, CPU)  # auto: emulated
    assert FP8Config().resolve_backend(H100) == "te" and FP8Config().resolve_backend(CPU) == "emulated"
    assert FP8Config(backend="emulated").resolve_backend(H100) == "emulated"
    run(model=families.tiny(num_layers=4), parallel=ParallelConfig(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)).validate(2, CPU)


def test_the_fp8_backend_is_decided_once_into_the_job():
    """The launcher decides every machine-dependent choice into the job (`core.launching.job.decided`); a worker reads it and
    never decides again: an undecided config is refused where it would be read."""
    from pai_cookbook.core.launching.job import decided
    from pai_cookbook.train import Sweep

    asked = run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config()))
    with pytest.raises(ValueError, match="still 'auto'"):
        _ = asked.precision.fp8.decided_backend
    assert decided(asked, CPU)[0].precision.fp8.decided_backend == "emulated"
    assert decided(asked, H100)[0].precision.fp8.decided_backend == "te"
    assert asked.precision.fp8.backend == "auto"  # the caller's config is left as it was
    sweep = Sweep(names=["a", "b"], folders=["a", "b"], runs=[asked, run()])
    assert [r.precision.fp8 and r.precision.fp8.backend for r in decided(sweep, CPU)[0].runs] == ["emulated", None]
    assert decided(run(), CPU) == (run(), CPU)
    with pytest.raises(ConfigError, match="backend='te' needs Transformer Engine"):  # a decision this machine refuses
        decided(run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(backend="te"))), CPU)


def test_a_te_gpu_on_the_local_layers_builds_no_fused_kernel():
    """On a GPU with Transformer Engine asked for the local layers (`PAI_COOKBOOK_LAYERS=local`), every fused-kernel
    switch is off: Megatron-Core's local ColumnParallelLinear raises without Apex's weight-gradient kernel when
    `gradient_accumulation_fusion` is on, and the other fusions are TE's or Apex's. (Decided from the device's
    Transformer Engine once flipped every switch on.)"""
    from pai_cookbook.core.modeling.model import transformer_config

    local = dataclasses.replace(H100, layers=build.choose_layers(True, True, {build.LAYERS_ENV: "local"}))
    assert local.layers == build.LOCAL_LAYERS and local.has_transformer_engine
    for family in ("llama", "mixtral"):
        config = transformer_config(families.tiny(family), ParallelConfig(), PrecisionConfig(), local)
        on = [name for name in build.FUSED_KERNELS if getattr(config, name)]
        assert on == [], on
        assert family == "llama" or config.moe_grouped_gemm is False
    assert build.record(local)["fused_kernels"] == [] and build.record(H100)["fused_kernels"] == sorted(build.FUSED_KERNELS)
    assert build.record(H100)["grouped_gemm"] and not build.record(local)["grouped_gemm"]


def test_emulated_fp8_on_a_te_gpu_builds_and_records_the_local_layers():
    """Emulated FP8's linears are the local spec's: on a Transformer Engine GPU the launcher's decision narrows the
    layers to `local`, so the run's record says what it built (it said `transformer-engine`), its fused kernels are off,
    and a device that was not narrowed is refused where the spec is built."""
    from pai_cookbook.core.launching.job import decided
    from pai_cookbook.core.modeling.layer_spec import layer_spec

    asked = run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config(backend="emulated")))
    job, device = decided(asked, H100)
    assert job.precision.fp8.backend == "emulated" and device.layers == build.LOCAL_LAYERS
    assert build.record(device)["layers"] == build.LOCAL_LAYERS and not device.fused_kernels
    assert decided(run(precision=PrecisionConfig(dtype="bf16", fp8=FP8Config())), H100)[1] == H100  # TE's FP8: TE
    with pytest.raises(ValueError, match="emulated FP8 builds the local spec"):
        layer_spec(families.tiny(), None, H100, seed=0, fp8=job.precision.fp8)
    # and on the local layers of a TE GPU, FP8 is emulated: TE's FP8 needs TE's layers
    local = dataclasses.replace(H100, layers=build.LOCAL_LAYERS)
    assert FP8Config().resolve_backend(local) == "emulated"
    with pytest.raises(ConfigError, match="builds no Transformer Engine layers"):
        FP8Config(backend="te").resolve_backend(local)


def test_the_cpu_converters_come_from_the_caller_exactly_on_the_cpu_path():
    from pai_cookbook.core.modeling.layer_spec import layer_spec

    local = dataclasses.replace(CPU, layers=build.LOCAL_LAYERS)
    with pytest.raises(ValueError, match="take the CPU converters"):
        layer_spec(families.tiny(), None, dataclasses.replace(CPU, layers=build.CPU_LAYERS), seed=0)
    with pytest.raises(ValueError, match="take no CPU converters"):
        layer_spec(families.tiny(), None, local, seed=0, converters=object())


def test_data_parallel_size_is_derived():
    assert ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(16) == 4


def test_json_round_trip_and_unknown_keys(tmp_path):
    config = run("qwen2_moe", parallel=ParallelConfig(expert_model_parallel_size=2),
                 memory=MemoryConfig(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]))
    assert RunConfig.load(config.save(tmp_path / "c.json")) == config
    text = config.to_json().replace('"train_iters"', '"train_itres"')
    with pytest.raises(ConfigError, match=r"RunConfig has no field\(s\) \['train_itres'\]"):
        RunConfig.from_json(text)


def test_padded_vocab_is_a_multiple_of_128_times_tp():
    model = families.tiny(vocab_size=32_000)
    assert model.padded_vocab_size(1) == 32_000 and model.padded_vocab_size(2) == 32_000
    assert families.tiny(vocab_size=151_646).padded_vocab_size(4) == 152_064


def test_token_budget_becomes_steps():
    from pai_cookbook.core.configs.config import with_token_budget
    base = run(data=DataConfig(seq_length=64, micro_batch_size=2, global_batch_size=8))  # 512 tokens per step
    config = with_token_budget(base, train_tokens=100_000, warmup_tokens=10_240)
    assert config.train_iters == 196 and config.optimizer.lr_warmup_iters == 20  # ceil(100000 / 512), 10240 / 512
    with pytest.raises(ConfigError, match=r"train_tokens 100 is less than one step of 512 tokens"):
        with_token_budget(base, train_tokens=100)


def test_a_run_from_a_checkpoint_takes_its_model_and_precision_and_resumes_unless_overwritten(converted, tmp_path):
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.core.configs.config import DataConfig, RunConfig

    ckpt = converted["qwen2"][1]
    run = RunConfig.from_checkpoint(ckpt, save_dir=tmp_path / "next", train_iters=3,
                                    data=DataConfig(seq_length=32, micro_batch_size=2, global_batch_size=4))
    model, dtype = checkpoint.read_config(ckpt)
    assert run.model == model and run.precision.dtype == checkpoint.DTYPE_NAMES[dtype] and run.train_iters == 3
    assert (run.checkpoint.load_dir, run.checkpoint.save_dir, run.checkpoint.resume) == (
        str(ckpt), str(tmp_path / "next"), True)
    fresh = RunConfig.from_checkpoint(ckpt, save_dir=tmp_path / "next", overwrite=True)
    assert fresh.checkpoint.overwrite and not fresh.checkpoint.resume
