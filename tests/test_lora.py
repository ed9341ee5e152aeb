"""LoRA on Megatron-Core's parallel linears (`core.modeling.lora`): the adapters start as the base model, train as one
model at every TP layout (sequence parallelism included), train alone, and checkpoint alone."""

from __future__ import annotations

import dataclasses

import pytest

from pai_cookbook import train
from pai_cookbook.core.checkpoints import checkpoint, checkpoint_config
from pai_cookbook.core.configs.config import CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig, RunConfig
from pai_cookbook.core.configs.lora import TARGETS, LoRAConfig
from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.machine import build, device_guard

STEPS = 10
QUIET = {"echo": False, "show_progress": False}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama's Megatron-Core checkpoint (converted from a Hugging Face folder, as a user's model is; grouped
    query attention: 4 heads in 2 groups)."""
    from pai_cookbook import convert
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("lora_base")
    ckpt = root / "mcore"
    convert.hf_to_megatron(make_tiny_hf_model("llama", root / "hf"), ckpt)
    return ckpt


@pytest.fixture(scope="module")
def conversations(base, tmp_path_factory):
    """24 random conversations of 5-60 ids of the base's tokenizer, the first ~40% of each a prompt outside the loss,
    packed into 64-position rows: 20 to train on, 4 held out."""
    from pai_cookbook import sft
    from pai_cookbook.core.text import tokenizer
    from tests.conftest import random_sft_samples

    samples = random_sft_samples()
    folder = tmp_path_factory.mktemp("lora_sft") / "set"
    assets = base / checkpoint.HF_ASSETS
    sft.write(folder, {"train": samples[:20], "valid": samples[20:]}, 64, pad_id=0, vocab_size=256,
              tokenizer=str(assets), tokenizer_sha256=tokenizer.fingerprint(assets))
    return folder


def run(base, conversations, lora: LoRAConfig | None = LoRAConfig(rank=4, alpha=8.0), save_dir=None,
        steps: int = STEPS, **fields) -> RunConfig:
    model, _ = checkpoint.read_config(base)
    return RunConfig(model=model, lora=lora, train_iters=steps, seed=7,
                     data=DataConfig(source="sft", paths=[str(conversations)], seq_length=64, micro_batch_size=2,
                                     global_batch_size=8),
                     optimizer=OptimizerConfig(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2),
                     checkpoint=CheckpointConfig(load_dir=str(base), save_dir=save_dir and str(save_dir)), **fields)


@pytest.mark.parametrize("fields, message", [
    ({"rank": 0}, "rank 0 must be an integer >= 1"),
    ({"alpha": 0}, "alpha 0 must be > 0"),
    ({"targets": ["q_proj"]}, r"\['q_proj'\] matches no adapter target.*q/k/v are linear_qkv"),
    ({"targets": []}, "none given"),
])
def test_bad_lora_settings_name_the_fix(fields, message):
    with pytest.raises(ConfigError, match=message):
        LoRAConfig(**fields)


def test_lora_needs_a_base_and_builds_the_local_spec_on_a_te_gpu():
    from pai_cookbook.core.checkpoints import families

    with pytest.raises(ConfigError, match="LoRA adapts a trained model: set checkpoint.load_dir"):
        RunConfig(model=families.tiny(), lora=LoRAConfig())
    assert LoRAConfig().narrow_layers(build.TE_LAYERS) == build.LOCAL_LAYERS
    assert LoRAConfig().narrow_layers(build.CPU_LAYERS) == build.CPU_LAYERS


@pytest.mark.multiproc
def test_adapters_start_as_the_base_and_train_as_peft_does_at_every_tp_layout(base, conversations, tmp_path,
                                                                              run_scenario):
    """B starts at zero, so the first step's loss is the base's (the full fine-tuning run's first loss, same data);
    only the adapters train, as many parameters as PEFT trains on the Hugging Face model (one adapter per q/k/v and
    gate/up projection); and the losses of 10 steps are PEFT's on transformers (same rows, A, optimizer and schedule:
    `hf_baseline.peft_sft`) within 1e-5 per step in fp32 at TP=1, TP=2 and TP=2 with sequence parallelism."""
    from pai_cookbook import hf_baseline

    full = train.run(run(base, conversations, lora=None), run_dir=tmp_path / "full", **QUIET)
    config = run(base, conversations)
    one = train.run(config, run_dir=tmp_path / "tp1", **QUIET)
    assert one["losses"][0] == full["losses"][0]
    assert one["losses"][-1] < one["losses"][0] - 0.01  # the adapters learn
    reference = hf_baseline.peft_sft(base.parent / "hf", config)
    assert one["trainable_parameters"] == reference["trainable"]
    assert full["trainable_parameters"] > 10 * one["trainable_parameters"]
    assert one["losses"] == pytest.approx(reference["losses"], abs=1e-5), (one["losses"], reference["losses"])
    layouts = [run(base, conversations, parallel=ParallelConfig(tensor_model_parallel_size=2)),
               run(base, conversations, parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))]
    for layout, other in zip(layouts, run_scenario.layouts(layouts, 2)):
        assert other["losses"] == pytest.approx(reference["losses"], abs=1e-5), layout.parallel
        # the model's count, not one rank's (rank 0's was 13,200 of 18,336 at TP=2)
        assert other["trainable_parameters"] == reference["trainable"], layout.parallel


def test_adapters_train_under_full_recompute(base, conversations, tmp_path):
    """Under full recompute the layers run inside Megatron-Core's checkpoint function, which gives its output a
    gradient only when an input needs one, and the frozen embedding's output does not: without the cookbook's hook the
    adapters got no gradient and the run trained nothing. Recomputed, the losses are the plain run's."""
    from pai_cookbook.core.configs.config import MemoryConfig

    plain = train.run(run(base, conversations, steps=3), run_dir=tmp_path / "plain", **QUIET)
    recomputed = train.run(run(base, conversations, steps=3, memory=MemoryConfig(recompute_granularity="full")),
                           run_dir=tmp_path / "recomputed", **QUIET)
    assert plain["losses"][-1] < plain["losses"][0] - 1e-3  # trained (the warmup's first step moves nothing)
    assert recomputed["losses"] == pytest.approx(plain["losses"], abs=1e-6)


@pytest.mark.multiproc
def test_an_adapter_checkpoint_holds_the_adapters_alone_and_resumes_exactly(base, conversations, tmp_path):
    """The checkpoint is the adapters and their optimizer state, no base weight (the base is its load_dir, named by
    identity); stopped at step 5 and resumed to 10 it gives the straight run's losses; on another base it is refused
    before any worker starts."""
    save = tmp_path / "adapters"
    config = run(base, conversations, save_dir=save)
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, save_interval=5))
    straight = train.run(config, run_dir=tmp_path / "straight", **QUIET)
    first, last = checkpoint.finished_iterations(save)
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(first)).read_metadata().state_dict_metadata
    weights = [k for k in stored if k.startswith(("embedding.", "decoder.", "output_layer."))]
    assert weights and all(".lora_" in k for k in weights), weights  # no base weight, and every adapter
    # an A per target, a B per projection (q, k, v; o; gate, up; down), every layer's in one entry
    assert len(weights) == len(TARGETS) + 7 and any(k.startswith("optimizer.") and ".lora_" in k for k in stored)
    assert checkpoint.read_state(first)["lora_base"]["identity"] == checkpoint_config.identity(base)
    import shutil

    shutil.rmtree(last)  # stopped after step 5: the same call resumes there
    resumed = train.run(config, run_dir=tmp_path / "rest", **QUIET)
    assert resumed["first_step"] == 5
    assert straight["losses"][5:] == pytest.approx(resumed["losses"], abs=1e-6)
    other = tmp_path / "other_base"
    shutil.copytree(base, other)
    (other / "extra.txt").write_text("another checkpoint")
    with pytest.raises(ConfigError, match="its adapters were trained on"):
        train.run(dataclasses.replace(run(base, conversations, save_dir=save, steps=12),
                                      checkpoint=CheckpointConfig(load_dir=str(other), save_dir=str(save))), **QUIET)


@pytest.mark.multiproc
def test_merged_and_peft_exported_adapters_compute_what_the_cookbook_trained(base, conversations, tmp_path,
                                                                            monkeypatch):
    """Adapters trained at TP=2 with sequence parallelism, on the GPU's local layers under the device guard (the path
    a GPU runs LoRA on), then: merged into the base (a full checkpoint, which transformers computes as Megatron-Core
    does on its export), and exported as a PEFT adapter that `peft.PeftModel` loads on the base's own export: its
    logits equal the merged model's to fp32 rounding. The fused QKV and gate/up adapters' B split by the rows the
    weights are split by, their A shared: exact."""
    import torch
    import transformers

    peft = pytest.importorskip("peft")
    from pai_cookbook import convert, lora, parity
    from pai_cookbook.core.measures.logit_parity import hf_logits, token_batch

    save = tmp_path / "adapters"
    config = run(base, conversations, save_dir=save, steps=4,
                 parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    monkeypatch.setenv(build.LAYERS_ENV, build.LOCAL_LAYERS)  # the workers inherit both
    monkeypatch.setenv(device_guard.ENV, "1")
    trained = train.run(config, nproc_per_node=2, run_dir=tmp_path / "train", **QUIET)
    assert trained["layers"]["layers"] == build.LOCAL_LAYERS
    merged = tmp_path / "merged"
    assert lora.merge(save, merged)["merged"] == 2 * 4  # 2 layers x 4 targets
    merged_hf, base_hf = tmp_path / "merged_hf", tmp_path / "base_hf"
    convert.megatron_to_hf(merged, merged_hf)
    convert.megatron_to_hf(base, base_hf)
    row = parity.check(merged_hf, merged, run_dir=tmp_path / "parity")
    assert row["max_abs_diff"] <= 1e-5 and row["argmax_agreement"] == 1.0
    exported = lora.export_peft(save, tmp_path / "peft")
    assert exported["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"])
    tokens = token_batch(base / checkpoint.HF_ASSETS)
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32), tmp_path / "peft").eval()
    with torch.no_grad():
        through_peft = adapted(tokens).logits.float()
    reference = hf_logits(merged_hf, tokens)
    unadapted = hf_logits(base_hf, tokens)
    assert (through_peft - reference).abs().max() <= 1e-5
    assert (unadapted - reference).abs().max() > 1e-3  # the adapters changed the model: the check above could fail
    # the adapter names a loadable base (the Hugging Face folder the base was converted from; it named the Megatron-Core
    # checkpoint, so AutoPeftModelForCausalLM failed), and loads whole from its folder alone
    assert peft.PeftConfig.from_pretrained(tmp_path / "peft").base_model_name_or_path == str(base.parent / "hf")
    alone = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (alone(tokens).logits.float() - through_peft).abs().max() <= 1e-6


def test_adapters_the_model_has_no_place_for_are_refused_before_launch(base, conversations):
    """A rank above a target's width, targets that a model lacks (multi-latent attention has no fused QKV; an MoE
    layer's experts take no adapter): refused when the run is built, naming the fix."""
    from pai_cookbook.core.checkpoints import families

    with pytest.raises(ConfigError, match="rank 64 exceeds the narrowest adapted layer's width"):
        run(base, conversations, lora=LoRAConfig(rank=64))
    latent = families.tiny("deepseek_v3")
    with pytest.raises(ConfigError, match=r"none is in this deepseek_v3 model.*linear_proj"):
        RunConfig(model=latent, lora=LoRAConfig(targets=["linear_qkv"]),
                  checkpoint=CheckpointConfig(load_dir=str(base)))
    RunConfig(model=latent, lora=LoRAConfig(), checkpoint=CheckpointConfig(load_dir=str(base)))  # its other targets


def test_a_frozen_moe_base_stays_frozen(conversations, tmp_path):
    """DeepSeek-V3's router bias is updated by Megatron-Core from the routed tokens, no gradient step; under LoRA it
    stays the base's (the adapter checkpoint holds no bias, so a moved one would leave the merged model another than
    the run's). At a learning rate of 1e-30 the adapters stay zero to fp32 rounding, so the model is the base and its
    validation loss ends where it started. The bias update runs at 0.1 here: the converter's 1e-3 moves a tiny router's
    bias too little to flip a choice in three steps; at 0.1 the loss moved 8.9e-4 on the old code)."""
    from pai_cookbook import convert
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    base = tmp_path / "mcore"
    convert.hf_to_megatron(make_tiny_hf_model("deepseek_v3", tmp_path / "hf"), base, run_dir=tmp_path / "convert")
    model, _ = checkpoint.read_config(base)
    assert model.moe_router_enable_expert_bias
    config = dataclasses.replace(
        run(base, conversations, lora=LoRAConfig(rank=4, alpha=8.0, targets=("linear_proj",)), steps=3),
        model=dataclasses.replace(model, moe_router_bias_update_rate=0.1), eval_interval=3, eval_iters=1,
        optimizer=OptimizerConfig(lr=1e-30, min_lr=1e-30, lr_warmup_iters=0))
    result = train.run(config, run_dir=tmp_path / "run", **QUIET)
    (_, before), (_, after) = result["valid_losses"][0], result["valid_losses"][-1]
    assert abs(after - before) <= 1e-7, (before, after)


def test_a_base_written_again_in_place_is_another_base(conversations, tmp_path):
    """A base re-converted in place from other weights of the same shape (same folder, same config, same file sizes)
    is another checkpoint: merging or resuming the adapters trained on the old one is refused (it merged them onto
    weights they were never trained on, without a word)."""
    from pai_cookbook import convert, lora
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    hf, base, save = tmp_path / "hf", tmp_path / "mcore", tmp_path / "adapters"
    convert.hf_to_megatron(make_tiny_hf_model("llama", hf, seed=0), base, run_dir=tmp_path / "c0")
    config = run(base, conversations, save_dir=save, steps=3)
    train.run(config, run_dir=tmp_path / "run", **QUIET)
    make_tiny_hf_model("llama", hf, seed=1)  # other weights, the same shape, the same folder
    convert.hf_to_megatron(hf, base, overwrite=True, run_dir=tmp_path / "c1")
    with pytest.raises(ConfigError, match="another checkpoint now: put that base back"):
        lora.merge(save, tmp_path / "merged")
    with pytest.raises(ConfigError, match="its adapters were trained on"):
        train.run(dataclasses.replace(config, train_iters=5), run_dir=tmp_path / "more", **QUIET)


@pytest.mark.second_stream  # about 4 minutes: run beside the notebooks (ci/test.sh)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text"])
def test_an_moe_or_2026_models_peft_export_loads_as_trained_or_is_refused(family, tmp_path):
    """Every MoE family, and Gemma 3 (its attention's and MLP's outputs normed after the adapters add theirs, as PEFT
    adds them before the post-norm): adapters on every target (an MoE layer's experts take none) exported as a PEFT
    adapter load
    through `peft.PeftModel` on the base's export with logits equal to the merged model's to fp32 rounding; except
    where an MoE model has dense layers whose MLP is adapted (DeepSeek-V3's first), which PEFT on transformers 5 would
    load unadapted (it reads gate_proj/up_proj/down_proj as the experts' fused weights: 0.03 from the merged logits
    on this model when it was exported): refused, naming those layers and the ways through, before a worker starts,
    and its attention-only adapter, the way through, exports exactly."""
    import torch
    import transformers

    peft = pytest.importorskip("peft")
    from pai_cookbook import convert, lora, sft
    from pai_cookbook.core.measures.logit_parity import hf_logits, token_batch
    from pai_cookbook.core.text import tokenizer
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model
    from tests.conftest import random_sft_samples

    base = tmp_path / "mcore"
    convert.hf_to_megatron(make_tiny_hf_model(family, tmp_path / "hf"), base, run_dir=tmp_path / "convert")
    assets = base / checkpoint.HF_ASSETS
    samples = random_sft_samples()
    sft.write(tmp_path / "set", {"train": samples[:20], "valid": samples[20:]}, 64, pad_id=0, vocab_size=256,
              tokenizer=str(assets), tokenizer_sha256=tokenizer.fingerprint(assets))
    base_hf = tmp_path / "base_hf"
    convert.megatron_to_hf(base, base_hf)
    tokens = token_batch(assets)

    def exported_equals_merged(targets: tuple[str, ...], name: str) -> None:
        save = tmp_path / name
        train.run(run(base, tmp_path / "set", lora=LoRAConfig(rank=4, alpha=8.0, targets=targets), save_dir=save,
                      steps=3), run_dir=tmp_path / f"{name}_run", **QUIET)
        if name == "refused":
            with pytest.raises(ConfigError, match=r"adapts the MLP \(linear_fc1, linear_fc2\) of the dense layers \[0\]"
                                                  r" of an MoE model \(deepseek_v3\).*lora.merge.*linear_proj"):
                lora.export_peft(save, tmp_path / f"{name}_peft")
            assert not (tmp_path / f"{name}_peft").exists()
            return
        lora.merge(save, tmp_path / f"{name}_merged")
        convert.megatron_to_hf(tmp_path / f"{name}_merged", tmp_path / f"{name}_merged_hf")
        lora.export_peft(save, tmp_path / f"{name}_peft")
        adapted = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32), tmp_path / f"{name}_peft")
        with torch.no_grad():
            through_peft = adapted.eval()(tokens).logits.float()
        reference = hf_logits(tmp_path / f"{name}_merged_hf", tokens)
        assert (through_peft - reference).abs().max() <= 1e-5, (family, targets)
        assert (hf_logits(base_hf, tokens) - reference).abs().max() > 1e-3  # the adapters changed the model

    if family == "deepseek_v3":  # multi-latent attention: no fused QKV; a dense first layer
        exported_equals_merged(("linear_proj", "linear_fc1", "linear_fc2"), "refused")
        exported_equals_merged(("linear_proj",), "attention")
    else:
        exported_equals_merged(TARGETS, "every")
