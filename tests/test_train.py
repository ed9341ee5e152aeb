"""The training worker: layout parity on a corpus, atomic checkpoints, exact resume after a kill, refusal to overwrite."""

import dataclasses
import json
import subprocess

import psutil
import pytest

from pai_cookbook import train
from pai_cookbook.core.checkpoints import checkpoint, families
from pai_cookbook.core.configs.config import CheckpointConfig, ConfigError, DataConfig, OptimizerConfig, ParallelConfig
from pai_cookbook.workers import training as train_worker
from tests.conftest import tiny_run, train_in_background


def test_checkpoints_are_saved_atomically_and_never_overwritten_silently(tmp_path):
    save_dir = tmp_path / "ckpt"
    config = tiny_run(checkpoint=CheckpointConfig(save_dir=str(save_dir), save_interval=1, keep_last=2),
                      train_iters=3, data=DataConfig(seq_length=16, micro_batch_size=2, global_batch_size=2))
    result = train.run(config, run_dir=tmp_path / "run", show_progress=False, echo=False)
    kept = checkpoint.finished_iterations(save_dir)
    assert [p.name for p in kept] == ["iter_0000002", "iter_0000003"]  # keep_last=2
    assert result["checkpoint"] == str(kept[-1])
    model, _ = checkpoint.read_config(kept[-1])  # self-describing
    assert model == config.model
    assert not list(save_dir.glob("*.partial"))
    fresh = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=False))
    with pytest.raises(FileExistsError, match=r"already holds files.*checkpoint.overwrite=True"):
        train.run(fresh, run_dir=tmp_path / "run2")
    assert not (tmp_path / "run2").exists(), "refused before any worker started"


def _kill_tree(proc: subprocess.Popen) -> None:
    tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)


@pytest.mark.both_ends
@pytest.mark.multiproc
def test_killed_run_resumes_exactly(tmp_path):
    """SIGKILL every process of a TP=2 run once a checkpoint exists; the resumed steps equal an uninterrupted
    run's. (TP=2 is the harder case: two processes killed, a sharded checkpoint; one process is the same code.)"""
    parallel = ParallelConfig(tensor_model_parallel_size=2)
    nproc, steps = parallel.tensor_model_parallel_size, 24

    def config(save_dir):
        return tiny_run(parallel=parallel, train_iters=steps,
                        checkpoint=CheckpointConfig(save_dir=str(save_dir), save_interval=4, keep_last=10))
    reference = train.run(config(tmp_path / "ref"), nproc_per_node=nproc, run_dir=tmp_path / "r0",
                          show_progress=False, echo=False)["losses"]
    victim = train_in_background(config(tmp_path / "ckpt"), tmp_path, nproc, tmp_path / "r1")
    _kill_tree(victim)
    kept = checkpoint.finished_iterations(tmp_path / "ckpt")
    assert kept and kept[-1].name != f"iter_{steps:07d}", "the run must be killed before it finishes"
    # A checkpoint interrupted mid-write is never what a resume loads.
    (tmp_path / "ckpt" / f"iter_{steps - 1:07d}{checkpoint.PARTIAL_SUFFIX}").mkdir()
    resumed = train.run(config(tmp_path / "ckpt"), nproc_per_node=nproc, run_dir=tmp_path / "r2",
                        show_progress=False, echo=False)
    first = resumed["first_step"]
    assert resumed["started_from"] == str(kept[-1]) and 4 <= first < steps
    assert resumed["losses"] == pytest.approx(reference[first:], abs=1e-5)


def test_resume_at_another_layout_is_refused_before_launch(tmp_path):
    save_dir = tmp_path / "ckpt"
    train.run(tiny_run(train_iters=1, checkpoint=CheckpointConfig(save_dir=str(save_dir))), run_dir=tmp_path / "r",
              show_progress=False, echo=False)
    other = tiny_run(train_iters=2, parallel=ParallelConfig(tensor_model_parallel_size=2),
                     checkpoint=CheckpointConfig(save_dir=str(save_dir)))
    with pytest.raises(ConfigError, match=r"cannot resume .*iter_0000001: it was saved at .*'tp': 1.*this run is "
                                          r".*'tp': 2.*checkpoint.load_dir"):
        train.run(other, nproc_per_node=2, run_dir=tmp_path / "r2")


def test_starting_from_a_checkpoint_of_another_model_is_refused(tmp_path):
    save_dir = tmp_path / "ckpt"
    train.run(tiny_run(train_iters=1, checkpoint=CheckpointConfig(save_dir=str(save_dir))), run_dir=tmp_path / "r",
              show_progress=False, echo=False)
    wider = tiny_run(model_overrides={"ffn_hidden_size": 256},
                     checkpoint=CheckpointConfig(load_dir=str(checkpoint.finished_iterations(save_dir)[-1])))
    with pytest.raises(ConfigError, match=r"differs from config.model in \['ffn_hidden_size'\]"):
        train.run(wider, run_dir=tmp_path / "r2")


def test_synthetic_batches_split_one_global_batch_over_dp_ranks():
    config = tiny_run(data=DataConfig(seq_length=8, micro_batch_size=1, global_batch_size=4))
    whole = train_worker.synthetic_batches(config, step=3, dp_rank=0, dp_size=1)
    halves = [mb for rank in range(2) for mb in train_worker.synthetic_batches(config, step=3, dp_rank=rank, dp_size=2)]
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(whole, halves))
    tokens, labels = whole[0]["tokens"][0], whole[0]["labels"][0]
    assert (labels[:-1] == tokens[1:]).all()
    stride = (tokens[1] - tokens[0]) % config.model.vocab_size
    assert ((tokens[1:] - tokens[:-1]) % config.model.vocab_size == stride).all()  # a progression


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3_text"])
def test_training_flops_are_six_per_weight_plus_attention(family):
    # 6 FLOPs per matmul weight per token (2 forward + 4 backward), the input embedding being a lookup,
    # plus 12 x seq x (heads x head_dim) a layer for attention scores and values, the window's keys in place of the
    # sequence's on a sliding-window layer (the tiny Mistral's every layer, the tiny Gemma 3's first: window 8 of 32).
    import transformers

    from pai_cookbook.core.modeling.model import training_flops_per_token
    model, seq = families.tiny(family), 32
    hf = transformers.AutoModelForCausalLM.from_config(families.to_hf(model))
    # tied embeddings count once in num_parameters but are used twice: lookup (free) and lm head
    matmul_weights = sum(p.numel() for n, p in hf.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if model.tie_word_embeddings:
        matmul_weights += model.vocab_size * model.hidden_size
    windows = [getattr(hf.config, "sliding_window", None) if kind == "sliding_attention" or family == "mistral"
               else None for kind in getattr(hf.config, "layer_types", None) or ["full_attention"] * model.num_layers]
    keys = sum(min(seq, w) if w else seq for w in windows)
    attention = 12 * keys * model.num_attention_heads * model.head_dim
    assert training_flops_per_token(model, seq) == 6 * matmul_weights + attention
    # LoRA's frozen base: no weight-gradient GEMM, 4 FLOPs per weight (forward and the input's gradient)
    assert training_flops_per_token(model, seq, frozen_weights=True) == 4 * matmul_weights + attention


def test_latent_attention_flops_count_its_latents_and_narrow_values():
    """DeepSeek-V3: 6 FLOPs per token per weight of the latent projections (read off transformers' model), of the dense
    first layer's MLP, and of the router, shared expert and top-k routed experts of the MoE layer; the scores over
    query/key heads 40 wide and the values over heads 20 wide."""
    import transformers

    from pai_cookbook.core.modeling.model import training_flops_per_token
    model, seq = families.tiny("deepseek_v3"), 32
    hf = transformers.AutoModelForCausalLM.from_config(families.to_hf(model))
    attention = sum(p.numel() for n, p in hf.named_parameters() if ".self_attn." in n and p.dim() == 2)
    h, fm = model.hidden_size, model.moe_ffn_hidden_size
    mlp = 3 * h * model.ffn_hidden_size + model.num_experts * h + (model.moe_router_topk + 1) * 3 * h * fm
    scores = 6 * model.num_layers * seq * model.num_attention_heads * (model.head_dim + model.v_head_dim)
    assert training_flops_per_token(model, seq) == 6 * (attention + mlp + model.vocab_size * h) + scores


def test_step_log_is_written_per_step(tmp_path):
    result = train.run(tiny_run(train_iters=3), run_dir=tmp_path, show_progress=False, echo=False)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    # a CPU has no datasheet peak: MFU is None there, the fraction of the measured matmul peak is not
    assert all(x["mfu"] is None and 0 < x["mfu_of_measured_peak"] <= 1 and x["tokens_per_s"] > 0 for x in lines)
    assert [x["loss"] for x in lines] == result["losses"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from pai_cookbook import data
    from pai_cookbook.core.text.tokenizer import make_tokenizer

    folder = tmp_path_factory.mktemp("corpus")
    make_tokenizer(256).save_pretrained(folder / "tokenizer")
    data.prepare([data.write_default_corpus(folder / "corpus.jsonl")], folder / "ds", folder / "tokenizer",
                 show_progress=False)
    return folder / "ds"


@pytest.mark.both_ends
@pytest.mark.multiproc
def test_layouts_match_single_process_for_20_steps_on_a_corpus(corpus, run_scenario):
    """TP=2, PP=2 (layers seed their init by global layer number, so stage 2 builds the PP=1 model's layer
    2), DP=2 and DP=2 with the optimizer state sharded each train as one process does, on the corpus with
    validation. The four 2-process layouts share one launch."""
    def config(parallel, distributed_optimizer=False):
        return tiny_run(parallel=parallel, train_iters=20, eval_interval=10, data=DataConfig(
            source="indexed", paths=[str(corpus)], seq_length=32, micro_batch_size=2, global_batch_size=8),
            optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                                      use_distributed_optimizer=distributed_optimizer))

    reference = run_scenario(config(ParallelConfig()), 1)
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it learns
    layouts = [(ParallelConfig(tensor_model_parallel_size=2), False), (ParallelConfig(pipeline_model_parallel_size=2), False),
               (ParallelConfig(), False),   # 2 processes: DP=2
               (ParallelConfig(), True)]    # DP=2 with optimizer state sharded
    runs = run_scenario.layouts([config(parallel, sharded) for parallel, sharded in layouts], 2)
    for (parallel, _), other in zip(layouts, runs):
        assert other["losses"] == pytest.approx(reference["losses"], abs=1e-4), parallel
        assert [v for _, v in other["valid_losses"]] == pytest.approx([v for _, v in reference["valid_losses"]], abs=1e-4)


# The 2026 families' layouts: Qwen3's query and key norms over heads 24 wide where hidden / heads is 16 (a split that
# assumed hidden / heads would cut the QKV weight in the wrong places); DeepSeek-V3's latents (its down projections
# split over TP and gathered: `core.modeling.attention.LatentSelfAttention`, without which TP=2 drifted 1e-5 from one process
# by step 3), value heads narrower than query heads, grouped sigmoid routing whose expert bias moves every step, and a
# shared expert, at TP=2 with sequence parallelism (an MoE model needs it at TP > 1) and at EP=2; GLM-4.5's half-rotating
# heads with q/k/v biases and q/k norms, and the same router, likewise. Gemma 3's norms on the attention's and the MLP's
# outputs, whose weights' gradients are summed over TP under sequence parallelism, its two rotary tables and its window,
# at TP=2 with sequence parallelism and at PP=2 (one layer of each kind a stage). GPT-OSS's sinks (a parameter split
# over TP by head), biases everywhere, clamped experts and YaRN, at TP=2 with sequence parallelism and EP=2 (its
# experts at expert-TP 1) and at PP=2.
NEW_FAMILY_LAYOUTS = {
    "gpt_oss": [ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                               expert_tensor_parallel_size=1),
                ParallelConfig(pipeline_model_parallel_size=2)],
    "gemma3_text": [ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                    ParallelConfig(pipeline_model_parallel_size=2)],
    # Nemotron-H's Mamba-2 mixers (their per-rank parameters drawn whole: `core.modeling.hybrid`; the input projection
    # split per part, the scan over chunks of 8 of the 32 positions) between attention and MLP layers
    "nemotron_h": [ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                   ParallelConfig(pipeline_model_parallel_size=2)],
    # Qwen3-Next's gated DeltaNet (its parts drawn whole: `core.modeling.delta_net`) and gated attention, a mixture of
    # experts with a gated shared expert after the first and a dense MLP after the second
    "qwen3_next": [ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                   ParallelConfig(expert_model_parallel_size=2)],
    "qwen3": [ParallelConfig(tensor_model_parallel_size=2),
              ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)],
    "deepseek_v3": [ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                    ParallelConfig(expert_model_parallel_size=2)],
    "glm4_moe": [ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                 ParallelConfig(expert_model_parallel_size=2)],
}


# The 2026 families' issue asks 10 steps; the earlier ones were held to 5.
NEW_FAMILY_STEPS = {"gemma3_text": 10, "gpt_oss": 10, "nemotron_h": 10, "qwen3_next": 10}
HYBRIDS = ("nemotron_h", "qwen3_next")


@pytest.mark.multiproc
@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.second_stream] if f in HYBRIDS else [])
                                    for f in sorted(NEW_FAMILY_LAYOUTS)])  # the hybrids beside the notebooks in CI
def test_new_families_train_at_tp2_as_one_process_does(family, run_scenario):
    """5 steps (10 for `NEW_FAMILY_STEPS`) at each layout of `NEW_FAMILY_LAYOUTS` give one process's losses (1e-5)."""
    def config(parallel):
        return tiny_run(family, parallel=parallel, train_iters=NEW_FAMILY_STEPS.get(family, 5))

    reference = run_scenario(config(ParallelConfig()), 1)["losses"]
    runs = run_scenario.layouts([config(parallel) for parallel in NEW_FAMILY_LAYOUTS[family]], 2)
    for parallel, run in zip(NEW_FAMILY_LAYOUTS[family], runs):
        assert run["losses"] == pytest.approx(reference, abs=1e-5), parallel


@pytest.mark.multiproc
def test_dense_latent_attention_trains_at_tp2_as_one_process_does(run_scenario):
    """DeepSeek-V3's attention with dense MLPs at TP=2 without sequence parallelism, where `LatentSelfAttention` sums
    the rotary key's gradient over TP itself (with sequence parallelism upstream's gather over the sequence does)."""
    dense = {"num_experts": None, "moe_shared_expert_intermediate_size": None, "moe_router_num_groups": None,
             "moe_router_group_topk": None, "moe_router_enable_expert_bias": False}
    reference = run_scenario(tiny_run("deepseek_v3", model_overrides=dense, train_iters=5), 1)["losses"]
    run = run_scenario(tiny_run("deepseek_v3", model_overrides=dense, train_iters=5,
                                parallel=ParallelConfig(tensor_model_parallel_size=2)), 2)["losses"]
    assert run == pytest.approx(reference, abs=1e-5)


def test_moe_training_at_tp_without_sequence_parallelism_is_refused_before_launch(tmp_path):
    config = tiny_run("mixtral", parallel=ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match=r"training an MoE model at TP=2 needs sequence_parallel=True"):
        train.run(config, nproc_per_node=2, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_sweep_trains_each_run_as_run_would_and_logs_each_in_its_own_folder(tmp_path):
    first, second = tiny_run(train_iters=3), tiny_run(train_iters=3, seed=7)
    quiet = dict(show_progress=False, echo=False)
    swept = train.sweep({"seed 1": first, "seed/7": second}, run_dir=tmp_path / "sweep", **quiet)
    alone = train.run(second, run_dir=tmp_path / "alone", **quiet)
    assert list(swept) == ["seed 1", "seed/7"]
    # the second run of a launch trains exactly as it does alone: parallel state and RNG rebuilt per run
    assert swept["seed/7"]["losses"] == alone["losses"] and swept["seed 1"]["losses"] != alone["losses"]
    assert train.history(tmp_path / "sweep" / "seed_7")["losses"] == alone["losses"]
    assert train.history(tmp_path / "sweep" / "seed_1")["losses"] == swept["seed 1"]["losses"]
    with pytest.raises(ConfigError, match="same or an empty folder"):
        train.sweep({"a b": first, "a/b": second}, run_dir=tmp_path / "clash")
    assert not (tmp_path / "clash").exists(), "refused before any worker started"


@pytest.mark.multiproc
def test_fused_attention_computes_what_megatron_cores_unfused_attention_does(run_scenario):
    """`core.modeling.attention.SDPAttention` (the CPU default) against Megatron-Core's DotProductAttention, one seed, fp32,
    grouped-query attention (4 heads, 2 groups): logits of a causal batch and of packed rows with the block-
    diagonal mask within 1e-5 (the issue's bound; measured 2.1e-7 and 1.2e-7), and one backward pass's gradients
    within 1e-5 (measured 8.4e-9, the largest gradient 3.5e-2)."""
    figures = run_scenario(tiny_run(data=DataConfig(seq_length=64, micro_batch_size=3, global_batch_size=3)),
                           scenario="attention")
    assert figures["core_attention"] == ["SDPAttention", "DotProductAttention"]
    diff = figures["max_abs_diff"]
    assert diff["causal"] <= 1e-5 and diff["packed"] <= 1e-5, figures
    assert diff["grads"] <= 1e-5 and figures["grad_scale"] > 1e-3, figures
    assert figures["loss"][0] == pytest.approx(figures["loss"][1], abs=1e-6)


@pytest.mark.multiproc
def test_training_rotary_and_swiglu_compute_what_megatron_cores_do_bit_for_bit(run_scenario):
    """The local spec's training path rotates queries and keys without Megatron-Core's pass-through copies
    (`core.modeling.attention.rotate`) and runs SwiGLU as one autograd function (`cpu.glu`): one forward/backward of each
    model, once that way and once through Megatron-Core's `apply_rotary_pos_emb` and `MLP.forward`, gives the same
    loss and every parameter's gradient bit for bit (so nothing trained changes: notebook 08's PPO run without the
    KL penalty moved on a 1e-7 difference, docs/cpu-history.md). Grouped-query attention (Llama, also
    bf16 and an MLP width of 100, whose vector loops end in a remainder), biases and a tied embedding (Qwen2), query
    and key norms with experts (Qwen3-MoE, whose experts keep Megatron-Core's MLP), a sliding window (Mistral), query
    and key norms with a head width of their own (Qwen3)."""
    from pai_cookbook.core.configs.config import PrecisionConfig

    data = DataConfig(seq_length=48, micro_batch_size=3, global_batch_size=3)
    configs = [tiny_run("llama", data=data), tiny_run("llama", data=data, precision=PrecisionConfig(dtype="bf16")),
               tiny_run("llama", data=data, model_overrides={"ffn_hidden_size": 100}),
               tiny_run("qwen2", data=data), tiny_run("qwen3_moe", data=data), tiny_run("mistral", data=data),
               tiny_run("qwen3", data=data)]
    runs = run_scenario.layouts(configs, nproc=1, scenario="training_ops")
    assert [r["family"] for r in runs] == ["llama", "llama", "llama", "qwen2", "qwen3_moe", "mistral", "qwen3"]
    for run in runs:
        assert run["loss_equal"] and run["grads_equal"], run
        # each path ran: two layers' queries and keys rotated by Megatron-Core only when asked; dense SwiGLU by ours
        assert run["cookbook_calls"]["megatron_rotary"] == 0 and run["megatron_calls"]["megatron_rotary"] == 4, run
        dense = run["family"] != "qwen3_moe"
        assert run["cookbook_calls"]["swiglu"] == (2 if dense else 0) and run["megatron_calls"]["swiglu"] == 0, run


@pytest.mark.multiproc
def test_cpu_training_steps_with_torchs_fused_adam_and_resumes_exactly(run_scenario, tmp_path):
    """On CPU, Megatron-Core's Adam without Transformer Engine or Apex is torch's AdamW on its per-tensor loop;
    `cpu.adam.fuse_adam` puts every group on torch's fused kernel (the optimizer step of the benchmark model
    65 -> 32 ms). Three steps with it and with the loop: losses within 1e-6 and the parameters Adam updates within
    1e-6 (the same update in another order; measured at most 4.8e-7 and 4.6e-7, a few last bits of a norm weight
    near 1), but not equal bit for bit, which shows the fused kernel ran. Two ranks (DP=2): in fp32, with bf16
    mixed precision (fp32 main parameters), and with the distributed optimizer (also for a Mixtral at EP=2, whose
    experts get an optimizer of their own in Megatron-Core's chain). Each fused run saves after its third step and
    goes on two more; a resume from that save fuses the groups again and takes the same two steps with exactly the
    same losses. With the distributed optimizer that needs `core.checkpoints.checkpoint`'s handling of torch's
    Adam under Megatron-Core's distributed optimizer (its state filled before the load, each step count set after:
    without it the second resumed step's loss differed by 5.6e-4)."""
    from pai_cookbook.core.configs.config import PrecisionConfig

    data = DataConfig(seq_length=32, micro_batch_size=2, global_batch_size=4)

    def run(name, family="llama", distributed=False, **fields):
        return tiny_run(family, data=data, train_iters=3, checkpoint=CheckpointConfig(save_dir=str(tmp_path / name)),
                        optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, use_distributed_optimizer=distributed),
                        **fields)

    configs = [run("fp32"), run("bf16", precision=PrecisionConfig(dtype="bf16")), run("dist", distributed=True),
               run("moe", "mixtral", distributed=True, parallel=ParallelConfig(expert_model_parallel_size=2))]
    runs = run_scenario.layouts(configs, nproc=2, scenario="adam")
    assert [(r["family"], r["chained"]) for r in runs] == [("llama", 1)] * 3 + [("mixtral", 2)]
    for r in runs:
        assert r["built_fused"] and all(r["built_fused"]), r
        assert r["restored_step"] == 3 and all(r["restored_fused"]), r
        assert r["resumed"] == r["onwards"], r  # exactly: the resumed steps are the uninterrupted run's
        assert r["loss_diff"] <= 1e-6 and r["param_diff"] <= 1e-6, r
        assert not r["params_equal"], r
        assert r["losses"][-1] < r["losses"][0], r
