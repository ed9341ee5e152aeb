"""The planner on the GPUs users run: Transformer Engine's layer path term by term against what upstream's code saves,
NVIDIA's published layouts predicted to fit, context parallelism only where TE runs it, every interleaving depth
searched, and the GPUs PAI-DSW rents (what each cannot do refused by name). No GPU is needed: these are the model's
own arithmetic, checked against its sources; the CPU measurements are tests/test_plan.py's."""

from __future__ import annotations

import pytest

from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.plan import __main__ as plan_cli
from pai_cookbook.plan import activations, finetune, hardware, layouts, memory, published, search
from pai_cookbook.plan.hardware import GIB, Cluster
from pai_cookbook.plan.layouts import Layout, Workload
from pai_cookbook.plan.shapes import SHAPES

TE, LOCAL = "transformer-engine", "local"

@pytest.mark.parametrize("published", published.LAYOUTS, ids=lambda p: p.name)
def test_published_h100_layouts_are_predicted_to_fit(published):
    """Each runs on 80 GB H100s, so the plan must say it fits on the Transformer Engine path (the one they run). What
    the model predicts without the overhead leaves 1.7 GiB for it in NeMo's 8B layout and 2.6 in its 70B one:
    memory.FRAMEWORK_OVERHEAD_GIB (1.5) is bounded by them, and docs/planning.md says so."""
    model, layout, workload = SHAPES[published.shape], published.layout, published.workload
    layouts.check(model, layout, workload, published.world)
    peak = memory.peak_memory(model, layout, workload, published.world)
    gpu = hardware.gpu("H100-80GB").memory_gib * GIB
    assert peak.total <= gpu, {k: v / GIB for k, v in peak.terms().items()}
    assert search.evaluate(model, layout, workload, Cluster(gpu=hardware.gpu("H100-80GB"), gpus_per_node=8,
                                                             nodes=published.world // 8 or 1)).fits


def test_the_transformer_engine_path_saves_what_upstreams_code_saves():
    """Llama-3-8B's layer at seq 4096, micro-batch 2, TP2 with sequence parallelism, bf16, each term from its source:
    TE's LayerNormLinear keeps its input and output (e) and 1/rms (fp32) on the rank's slice; attention keeps the fused
    QKV output (v is a view of it), the rotated q and k, the kernel's output and its log-sum-exp, and no rotary cos/sin
    (TE's fused rotary kernel); the MLP keeps fc1's output (2f, the fused SwiGLU's saved input) and the activation's
    (f, fc2's input); the loss keeps exp(logits) in fp32 and its transient is the bf16 logits."""
    m = SHAPES["Llama-3-8B"]
    layout = Layout(tp=2, sequence_parallel=True, micro_batch_size=2)
    workload = Workload(seq_length=4096, global_batch_size=16)
    x = activations.dims(layout, workload)
    assert x.te and (x.s, x.s_norm, x.b, x.e) == (4096, 2048, 2, 2)
    h, q, kv, f, heads = 4096, 32 * 128, 8 * 128, 14336, 32
    tokens, slice_tokens = 4096 * 2, 2048 * 2
    assert activations.norm_bytes(m, x) == slice_tokens * (h * 2 + h * 2 + 4)
    kernel_stats = 2 * heads // 2 * 4096 * 4  # log-sum-exp, fp32, per sequence and head of this rank
    assert activations.attention_bytes(m, layout, x) == tokens * ((q + 2 * kv) + (q + kv) + q) // 2 * 2 + kernel_stats
    assert activations.mlp_bytes(m, layout, x, f) == tokens * (2 * f + f) // 2 * 2
    assert activations.layer_bytes(m, layout, x, 0) == (2 * activations.norm_bytes(m, x) + activations.attention_bytes(
        m, layout, x) + activations.mlp_bytes(m, layout, x, f))
    vocab = m.padded_vocab_size(2) // 2
    loss = tokens * vocab * 4 + tokens * (8 + 1) + tokens * 4 + 4  # exp(logits) fp32, targets and mask, loss mask
    assert activations.head_bytes(m, layout, x) == activations.norm_bytes(m, x) + loss
    last = memory.stage_memory(m, layout, workload, 2, 0)
    assert last.transient == tokens * vocab * 2  # Llama 3's vocabulary needs no padding at TP2: no masked copy
    # the local spec on the same layer, on a GPU: torch's fused RMSNorm keeps what TE's does (the input, 1/rms; the
    # next matmul the output), SwiGLU's five tensors, rotary cos and sin; on a CPU the norm keeps fp32 copies
    local = activations.dims(layout, Workload(seq_length=4096, global_batch_size=16, layers=LOCAL))
    assert activations.norm_bytes(m, local) == activations.norm_bytes(m, x)
    on_cpu = activations.dims(layout, Workload(seq_length=4096, global_batch_size=16, layers=LOCAL, device="cpu"))
    assert activations.norm_bytes(m, on_cpu) == slice_tokens * (h * (4 + 4 + 2) + 4)
    assert activations.mlp_bytes(m, layout, local, f) == tokens * 5 * f // 2 * 2
    assert activations.attention_bytes(m, layout, local) - activations.attention_bytes(m, layout, x) == 4 * 4096 * 128 * 2


def test_korthikanti_s_count_is_the_te_path_s_on_its_own_assumptions():
    """Korthikanti et al. 2022 (Table 2) count 34 s b h bytes per layer in fp16 for MHA with a GELU MLP of 4h, plus
    5 a s^2 b for the attention scores: without the scores (a flash kernel) and the two dropout masks (s b h each;
    these models train without dropout) that is 32 s b h. The TE path gives the same on those terms: 8 (two norms'
    inputs and outputs) + 16 (fc1's and GELU's outputs) + 8 (the QKV output and the kernel's) = 32, once what
    Korthikanti's model has no counterpart for is set apart: the rotated q and k (a rotary embedding, +4) and the fp32
    log-sum-exp and 1/rms."""
    from pai_cookbook.core.configs.model_config import ModelConfig

    h, s = 1024, 2048
    m = ModelConfig(family="llama", num_layers=1, hidden_size=h, ffn_hidden_size=4 * h, num_attention_heads=16,
                    num_query_groups=16, vocab_size=1024, max_position_embeddings=s, activation="gelu")
    layout = Layout()
    x = activations.dims(layout, Workload(seq_length=s, global_batch_size=1))
    sbh = s * h
    layer = activations.layer_bytes(m, layout, x, 0)
    rotated_copies = sbh * 2 * 2  # q and k rotated beside the QKV buffer (Korthikanti's model has no rotary embedding)
    small = 16 * s * 4 + 2 * s * 4  # log-sum-exp, two norms' 1/rms
    assert layer - rotated_copies - small == 32 * sbh


def test_context_parallelism_only_where_transformer_engine_runs_it():
    """The local spec refuses CP (Megatron-Core's local attention), and LoRA builds the local spec: no CP layout is
    planned there; on TE's path CP layouts are planned, marked for Megatron-LM/NeMo, and never chosen to run here."""
    model, cluster = SHAPES["Llama-3-8B"], Cluster(gpu=hardware.gpu("H100-80GB"))
    te = search.plan(model, cluster, Workload(seq_length=8192, global_batch_size=64))
    local = search.plan(model, cluster, Workload(seq_length=8192, global_batch_size=64, layers=LOCAL))
    adapters = search.plan(model, cluster, Workload(seq_length=8192, global_batch_size=64,
                                                    lora=LoRAConfig(rank=8, alpha=16.0)))
    assert any(o.layout.cp > 1 for o in te) and not any(o.layout.cp > 1 for o in local + adapters)
    with pytest.raises(ConfigError, match="needs Transformer Engine"):
        layouts.check(model, Layout(cp=2), Workload(seq_length=8192, global_batch_size=64, layers=LOCAL), 8)
    assert search.choose(te).layout.cp == 1
    cp_rows = [o for o in te if o.layout.cp > 1][:1]
    assert "[CP: TE, Megatron-LM/NeMo]" in search.table(cp_rows)


def test_every_interleaving_depth_is_searched():
    """Published layouts interleave 5 and 8 chunks per stage: the search takes every depth that divides a stage's
    layers (Llama-3-70B at PP4: 2, 4, 5, 10 and 20)."""
    found = {o.vpp for o in layouts.valid_layouts(SHAPES["Llama-3-70B"], Workload(seq_length=4096, global_batch_size=64),
                                                  32, 8) if o.pp == 4 and o.tp == 8}
    assert found == {None, 2, 4, 5, 10, 20}


def test_what_a_dsw_gpu_cannot_do_is_refused_by_name():
    model = SHAPES["Llama-3-8B"]
    with pytest.raises(ConfigError, match="V100-32GB has no bf16"):
        search.plan(model, Cluster(gpu=hardware.gpu("V100-32GB"), gpus_per_node=2), Workload(seq_length=2048,
                                                                                              global_batch_size=8))
    with pytest.raises(ConfigError, match="T4-16GB cannot run Transformer Engine"):
        search.plan(model, Cluster(gpu=hardware.gpu("T4-16GB"), gpus_per_node=2),
                    Workload(seq_length=2048, global_batch_size=8, dtype="fp32"))
    assert plan_cli.main(["--model", "Llama-3-8B", "--gpu", "T4-16GB", "--seq-length", "2048", "--global-batch",
                          "8"]) == 2
    with pytest.raises(ConfigError, match="is what a CPU run builds"):
        Workload(seq_length=2048, global_batch_size=8, layers="local+cpu")
    with pytest.raises(ConfigError, match="a plan is for GPUs"):
        search.plan(model, Cluster(gpu=hardware.gpu("H100-80GB"), gpus_per_node=2),
                    Workload(seq_length=2048, global_batch_size=8, layers="local", device="cpu"))


def test_fine_tuning_an_8b_model_on_the_gpus_dsw_rents():
    """Full fine-tuning holds 16 bytes per parameter before activations (bf16 weights, fp32 gradients and Adam): an 8B
    model fits no single GPU of 80 GB and fits two only sharded; LoRA holds the bf16 weights and little more, so one
    80 GB or 48 GB GPU takes it, a 24 GB A10 does not (its 15 GiB of weights plus activations and overhead), two do
    with the layers split; in fp32 (V100, T4) the weights alone take 30 GiB."""
    rows = {(r["GPU"], r["GPUs"], r["training"].split()[0]): r for r in finetune.plans(SHAPES["Llama-3-8B"])}
    fits = {key: row["fits"] for key, row in rows.items()}
    for gpu in ("A100-80GB", "H100-80GB"):
        assert (fits[(gpu, 1, "full")], fits[(gpu, 2, "full")], fits[(gpu, 1, "LoRA")]) == ("no", "yes", "yes")
    assert (fits[("L20-48GB", 1, "LoRA")], fits[("A10-24GB", 1, "LoRA")], fits[("A10-24GB", 2, "LoRA")]) == \
        ("yes", "no", "yes")
    assert fits[("T4-16GB", 2, "LoRA")] == "no" and rows[("T4-16GB", 1, "full")]["precision"] == "fp32"
    assert all(row["layers"] == LOCAL for key, row in rows.items() if key[2] == "LoRA" or key[0] in ("V100-32GB",
                                                                                                     "T4-16GB"))


def test_router_imbalance_slows_and_loads_the_busiest_expert_rank():
    """moe.ep_imbalance from router figures (by hand: shares 0.4, 0.2, 0.2, 0.2 over two ranks are blocks of 0.6 and
    0.4, 1.2 times their mean), and what it does to a plan: balanced routing adds nothing; at 1.5 the busiest rank's
    experts take half their FLOPs again, and their saved activations grow."""
    from pai_cookbook import moe
    from pai_cookbook.plan import speed

    history = [{"expert_load": [[0.4, 0.2, 0.2, 0.2]]}, {"expert_load": [[0.3, 0.3, 0.2, 0.2]]}]
    assert moe.ep_imbalance(history, ep=2) == pytest.approx((1.2 + 1.2) / 2)
    assert moe.ep_imbalance(history, ep=4) == pytest.approx((1.6 + 1.2) / 2)
    with pytest.raises(ValueError, match="does not divide"):
        moe.ep_imbalance(history, ep=3)
    model, layout = SHAPES["Mixtral-8x7B"], Layout(pp=4, ep=8, distributed_optimizer=True)
    cluster = Cluster(gpu=hardware.gpu("H100-80GB"), gpus_per_node=8, nodes=4)
    balanced, skewed = (Workload(seq_length=4096, global_batch_size=256, moe_imbalance=r) for r in (1.0, 1.5))
    even, uneven = (speed.step_time(model, layout, w, cluster) for w in (balanced, skewed))
    assert even.moe_imbalance == 0.0 and uneven.moe_imbalance > 0 and uneven.ep == pytest.approx(1.5 * even.ep)
    expert_flops = 3 * 2 * 32 * 2 * 3 * 4096 * 14336  # per token: fwd+bwd, layers, top-2, SwiGLU's 3 matrices
    rate = 32 * cluster.gpu.peak_flops("bf16") * cluster.gpu.mfu_for(model)
    assert uneven.moe_imbalance == pytest.approx(256 * 4096 * expert_flops * 0.5 / rate)
    assert memory.peak_memory(model, layout, skewed, 32).activations > memory.peak_memory(model, layout, balanced,
                                                                                          32).activations
    with pytest.raises(ConfigError, match="moe_imbalance"):
        Workload(seq_length=4096, global_batch_size=256, moe_imbalance=0.5)



def test_each_rank_s_expert_load_is_read_off_the_router_figures():
    """memory.expert_rank_load by hand: 4 experts, layers 0-1 dense and 2-3 MoE, PP2 EP2 on 4 ranks. Stage 0 holds no
    MoE layer (1.0 whatever the routing); on stage 1 rank 2 holds experts 0-1 (layer 2: 0.8 of the tokens, 1.6x the
    mean; layer 3: 0.5, 1.0x): their mean without recompute, the larger under full recompute."""
    from pai_cookbook.core.checkpoints import families

    model = families.tiny("mixtral", num_layers=4, moe_layer_freq=[0, 0, 1, 1])
    router = [{"expert_load": [[0.7, 0.1, 0.1, 0.1], [0.25] * 4]}]
    loads = [memory.expert_rank_load(router, model, Layout(pp=2, ep=2), 4, rank) for rank in range(4)]
    assert loads == pytest.approx([1.0, 1.0, 1.3, 0.7])
    full = Layout(pp=2, ep=2, recompute="full")
    assert [memory.expert_rank_load(router, model, full, 4, rank) for rank in range(4)] == pytest.approx(
        [1.0, 1.0, 1.6, 1.0])


def test_the_cli_plans_an_moe_model_at_the_router_load_it_is_given(capsys):
    argv = ["--model", "Mixtral-8x7B", "--gpus-per-node", "2", "--seq-length", "4096", "--global-batch", "8",
            "--top", "1"]
    assert plan_cli.main(argv) == 0
    balanced = capsys.readouterr().out
    assert plan_cli.main(argv + ["--moe-imbalance", "1.5"]) == 0
    skewed = capsys.readouterr().out
    assert "MoE routing balanced" in balanced and "MoE routing 1.5x the mean on the busiest rank" in skewed
    for bad in ("0.5", "inf", "nan"):
        assert plan_cli.main(argv + ["--moe-imbalance", bad]) == 2
        assert f"moe_imbalance {float(bad)!r} must be" in capsys.readouterr().err


def test_expert_tensor_parallelism_is_searched_apart_from_tp():
    """An MoE model at TP > 1 is planned with its experts at TP and unsplit (expert-TP 1), as Megatron-Core's MoE
    parallel folding allows."""
    found = {(o.tp, o.etp) for o in layouts.valid_layouts(SHAPES["Mixtral-8x7B"], Workload(
        seq_length=4096, global_batch_size=64), 16, 8) if o.ep == 8}
    assert (2, None) in found and (2, 1) in found
    assert "ETP1" in Layout(tp=2, ep=8, etp=1).describe()


def test_gradients_in_the_weights_dtype_halve_the_buffer():
    model, layout = SHAPES["Llama-3-8B"], Layout(distributed_optimizer=True)
    fp32, bf16 = (memory.peak_memory(model, layout, Workload(seq_length=4096, global_batch_size=64,
                                                             grad_reduce_in_fp32=g), 8) for g in (True, False))
    assert bf16.gradients * 2 == fp32.gradients and bf16.weights == fp32.weights


def test_the_step_time_reproduces_both_measured_h100_runs():
    """The MFU by width passes through both H100 runs (2026-11-26): the ~0.5B Llama at width 1024, 80,600 tokens/s (the
    1B run's MFU alone predicted 163,000), and the 1B shape at 2048 (tests/test_plan.py); it rises with the width
    between them and holds beyond."""
    from pai_cookbook.core.checkpoints import families
    from pai_cookbook.plan import speed

    half = families.tiny("llama").__class__(**{**vars(families.tiny("llama")), "num_layers": 24, "hidden_size": 1024,
                                               "ffn_hidden_size": 2816, "num_attention_heads": 16,
                                               "num_query_groups": 4, "kv_channels": 64,
                                               "max_position_embeddings": 2048})
    one = Cluster(gpu=hardware.gpu("H100-80GB"), gpus_per_node=1)
    time = speed.step_time(half, Layout(micro_batch_size=4), Workload(seq_length=2048, global_batch_size=8), one)
    assert time.tokens_per_s == pytest.approx(80_600, rel=0.01)
    gpu = hardware.gpu("H100-80GB")
    widths = [gpu.mfu_for(SHAPES[name]) for name in ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3-8B")]
    assert widths[0] == pytest.approx(0.368, abs=1e-3) and widths[0] == widths[1] == widths[2]
    assert gpu.mfu_for(half) < gpu.mfu_for(SHAPES["Llama-3.2-1B"])
