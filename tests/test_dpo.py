"""Preference tuning (`dpo`): the losses by hand and as TRL writes them, training equal to TRL's DPOTrainer on the same
pairs and model, TP=2 and PP=2 equal to one process, LoRA against its base, and what is refused before any worker starts."""

from __future__ import annotations

import math
import types

import pytest
import torch

from pai_cookbook import dpo
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig
from pai_cookbook.core.configs.lora import LoRAConfig
from pai_cookbook.core.rl import preference

QUIET = {"echo": False, "show_progress": False}


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny Llama with a ChatML byte tokenizer (notebook 08's), converted as a user's model is, in fp32."""
    from pai_cookbook import convert, sft
    from pai_cookbook.core.text import tokenizer
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("dpo")
    tokenizer.byte_level(sft.CHATML).save_pretrained(root / "tokenizer")
    hf = make_tiny_hf_model("llama", root / "hf", tokenizer_dir=root / "tokenizer", chat_template=sft.CHATML,
                            max_position_embeddings=128)
    convert.hf_to_megatron(hf, root / "start")
    return root


@pytest.fixture(scope="module")
def prepared(start):
    from pai_cookbook import tasks

    dpo.prepare(tasks.sorting_pairs(16, seed=2), start / "set", start / "start", valid=tasks.sorting_pairs(8, seed=3))
    return start / "set"


def test_losses_by_hand():
    """Each loss at values worked out on paper (DPO, its conservative form, IPO, SimPO, DPO with RPO's supervised term),
    and SimPO as TRL's CPOTrainer computes it from the same mean log-probabilities."""
    policy = (torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -8.0]))
    reference = (torch.tensor([-5.0, -9.5]), torch.tensor([-5.0, -8.5]))
    tokens = (torch.tensor([2.0, 3.0]), torch.tensor([4.0, 2.0]))
    delta = torch.tensor([(-4 + 5) - (-6 + 5), (-9 + 9.5) - (-8 + 8.5)])  # 2 and 0
    config = dpo.DPOConfig(beta=0.5)
    loss, chosen, rejected = preference.losses(config, policy, reference, tokens)
    assert torch.allclose(loss, torch.log1p(torch.exp(-0.5 * delta)))
    assert torch.allclose(chosen - rejected, 0.5 * delta)
    smoothed, _, _ = preference.losses(dpo.DPOConfig(beta=0.5, label_smoothing=0.2), policy, reference, tokens)
    assert torch.allclose(smoothed, 0.8 * torch.log1p(torch.exp(-0.5 * delta)) + 0.2 * torch.log1p(torch.exp(0.5 * delta)))
    ipo, _, _ = preference.losses(dpo.DPOConfig(loss="ipo", beta=0.5), policy, reference, tokens)
    averaged = torch.tensor([1 / 2 - (-1) / 4, 0.5 / 3 - 0.5 / 2])
    assert torch.allclose(ipo, (averaged - 1.0) ** 2)
    simpo = dpo.DPOConfig(loss="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1)
    loss, chosen, rejected = preference.losses(simpo, policy, reference, tokens)
    means = (policy[0] / tokens[0], policy[1] / tokens[1])
    logits = 2.0 * (means[0] - means[1]) - 0.5
    assert torch.allclose(loss, -0.9 * torch.nn.functional.logsigmoid(logits) - 0.1 * torch.nn.functional.logsigmoid(-logits))
    rpo, _, _ = preference.losses(dpo.DPOConfig(beta=0.5, sft_weight=2.0), policy, reference, tokens)
    assert torch.allclose(rpo, torch.log1p(torch.exp(-0.5 * delta)) + 2.0 * torch.tensor([4 / 2, 9 / 3]))
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    trl = types.SimpleNamespace(alpha=0.0, beta=2.0, simpo_gamma=0.5, label_smoothing=0.1, loss_type="simpo",
                                accelerator=types.SimpleNamespace(device="cpu"))
    theirs, their_chosen, their_rejected = CPOTrainer.cpo_loss(trl, *means)
    assert torch.allclose(loss, theirs) and torch.allclose(chosen, their_chosen) and torch.allclose(rejected, their_rejected)


def test_prepared_set(start, prepared):
    """Answers are scored from their first token through the template's stop token, after the prompt as the chat
    template renders it with its generation prompt; the reference's log-probabilities are the model's own."""
    from pai_cookbook import evaluate, tasks

    content = dpo.load(prepared)
    hf = evaluate.tokenizer(start / "start")
    for pair, source in zip(content["train"], tasks.sorting_pairs(16, seed=2), strict=True):
        for side in ("chosen", "rejected"):
            ids, begin = pair[side]["ids"], pair[side]["start"]
            assert hf.decode(ids[begin:]) == source[side] + "<|im_end|>"
            assert hf.decode(ids[:begin]).endswith(source["messages"][0]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    pair = content["train"][0]["chosen"]
    rescored = evaluate.loglikelihood_tokens(start / "start", [(pair["ids"][:pair["start"]], pair["ids"][pair["start"]:])],
                                             show_progress=False)["results"][0]["logprob"]
    assert abs(rescored - pair["reference"]) < 1e-5
    assert content["pairs"] == 16 and content["held_out"] == 8 and content["cut"] == 0


@pytest.mark.parametrize("loss, beta", [("sigmoid", 0.1), ("ipo", 5.0)])
def test_equals_trl(start, prepared, tmp_path, loss, beta):
    """fp32, the same pairs, model and optimizer: the loss equals TRL DPOTrainer's at step 0 within 1e-5 and after three
    updates within 1e-4 (measured on this machine: 3e-8 and 2.1e-5 for DPO). IPO runs at beta 5, where its gradient is
    the size of DPO's at 0.1: at beta 0.1 its loss starts at 25 and its gradient is ~200x DPO's, and Adam's first
    step, which moves every weight whose gradient passes eps by the full rate, turns rounding into loss gaps of ~1e-3
    (DPO itself at beta 5 shows the same: docs/dpo.md)."""
    from pai_cookbook import convert, hf_baseline

    hf = start / "hf_export"
    if not (hf / "config.json").exists():
        convert.megatron_to_hf(start / "start", hf)
    config = dpo.DPOConfig(loss=loss, beta=beta, steps=4, lr=1e-3, global_batch_size=16, micro_batch_size=4)
    theirs = hf_baseline.trl_dpo(hf, prepared, tmp_path / "trl", config)["losses"]
    mine = [s["loss"] for s in dpo.train(start / "start", prepared, config, run_dir=tmp_path / "run", **QUIET)["steps"]]
    assert len(mine) == len(theirs) == 4
    assert abs(mine[0] - theirs[0]) < 1e-5, (mine, theirs)
    assert abs(mine[3] - theirs[3]) < 1e-4, (mine, theirs)
    if loss == "sigmoid":
        assert abs(mine[0] - math.log(2)) < 1e-6 and mine[3] < mine[0] - 0.01  # the start is log 2; it learns


def test_the_pad_row_trains_where_transformers_freezes_it(start, prepared, tmp_path):
    """transformers builds the input embedding with `padding_idx=config.pad_token_id`, so TRL never moves that row;
    the cookbook trains every row (docs/preference-tuning.md). With no pad id (the model above) the two runs' updates
    of the embedding agree, the turn end's row included; with `<|im_end|>` as the pad id, as SmolLM2-Instruct sets
    it, they agree except that row, which moves in the cookbook's run (more than the average row: it ends every
    answer) and not at all in TRL's. fp32, 4 steps at 1e-3 with Adam's eps at 1e-4: weights are compared by their
    updates, relative to the update's size, because Adam moves a weight by about the rate whatever its gradient's
    size, so rounding in the smallest gradients shows at the rate's scale (measured: 1.9% apart over the other rows,
    3.4% on the turn end's; the bound is 5%)."""
    import json
    import shutil

    from pai_cookbook import convert, evaluate, hf_baseline

    end = evaluate.tokenizer(start / "start").convert_tokens_to_ids("<|im_end|>")
    hf = start / "hf_export"
    if not (hf / "config.json").exists():
        convert.megatron_to_hf(start / "start", hf)
    padded = tmp_path / "hf_padded"
    shutil.copytree(hf, padded)
    config_file = padded / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"pad_token_id": end}))
    config = dpo.DPOConfig(steps=4, lr=1e-3, global_batch_size=16, micro_batch_size=4, adam_eps=1e-4)
    run = dpo.train(start / "start", prepared, config, run_dir=tmp_path / "run", save_dir=tmp_path / "save", **QUIET)
    convert.megatron_to_hf(run["checkpoint"], tmp_path / "mine")
    before = hf_baseline.hf_model(hf).get_input_embeddings().weight.detach()
    mine = hf_baseline.hf_model(tmp_path / "mine").get_input_embeddings().weight.detach() - before
    others = torch.ones(len(mine), dtype=torch.bool)
    others[end] = False
    average_row = mine[others].norm(dim=1).mean().item()
    assert mine[end].norm().item() > 2 * average_row, (mine[end].norm().item(), average_row)
    for folder, pad in ((hf, None), (padded, end)):
        theirs = hf_baseline.trl_dpo(folder, prepared, tmp_path / f"trl_{pad}", config)["model"]
        theirs = theirs.get_input_embeddings().weight.detach() - before
        apart = {name: ((mine[rows] - theirs[rows]).norm() / mine[rows].norm()).item()
                 for name, rows in (("other rows", others), ("turn end", end))}
        assert apart["other rows"] < 0.05, f"pad id {pad}: {apart}"
        if pad is None:
            assert apart["turn end"] < 0.05, f"no pad id: {apart}"
        else:
            assert theirs[end].abs().max().item() == 0.0, f"TRL moved the pad row: {theirs[end].abs().max().item():.1e}"


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}],
                         ids=["TP2", "PP2"])
def test_layouts_equal_one_process(start, prepared, tmp_path, layout):
    """The same run at TP=2 or PP=2 (two processes, 4 micro-batches a step) and on one process: every step's loss and
    margin, and the held-out loss, within 1e-5 (fp32)."""
    config = dpo.DPOConfig(steps=4, lr=1e-3, global_batch_size=8, micro_batch_size=2)
    one = dpo.train(start / "start", prepared, config, run_dir=tmp_path / "one", **QUIET)
    two = dpo.train(start / "start", prepared, config, parallel=ParallelConfig(**layout), nproc_per_node=2,
                    run_dir=tmp_path / "two", **QUIET)
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["margin"] - b["margin"]) < 1e-5
    assert abs(one["valid"][-1]["loss"] - two["valid"][-1]["loss"]) < 1e-5


def test_a_run_driven_to_nan_stops_at_that_step_and_saves_nothing(start, prepared, tmp_path):
    """At a rate no weight survives (Adam moves every weight by about the rate, here 1e30) the second step is not finite
    (its gradient norm: DPO's log-sigmoid keeps the loss itself finite): the run stops there, names the step and the
    last finite checkpoint (the policy it started from) and saves nothing, as a training run does
    (tests/test_work_never_lost.py)."""
    from pai_cookbook import rlhf
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.core.launching.launch import WorkerError

    config = dpo.DPOConfig(steps=4, lr=1e30, global_batch_size=8, micro_batch_size=4)
    with pytest.raises(WorkerError, match=r"step 2: the loss is \S+ and the gradient norm \S+; the run stops here") as err:
        dpo.train(start / "start", prepared, config, save_dir=tmp_path / "out", run_dir=tmp_path / "run", **QUIET)
    assert f"last finite checkpoint is {start / 'start'}" in str(err.value)
    assert checkpoint.finished_iterations(tmp_path / "out") == []
    logged = rlhf.history(tmp_path / "run")
    figures = [(loss, norm) for loss, norm in zip(logged["loss"], logged["grad_norm"], strict=True)]
    assert len(figures) == 2 and all(map(math.isfinite, figures[0])) and not all(map(math.isfinite, figures[1]))


def test_lora_reference_is_the_base(start, prepared, tmp_path):
    """With LoRA the set prepared on the base is the reference: step 0 is log 2 (the adapters start as the base), the
    adapters learn, and the checkpoint holds the adapters alone, naming their base."""
    from pai_cookbook.core.checkpoints import checkpoint

    config = dpo.DPOConfig(steps=4, lr=1e-2, global_batch_size=8, micro_batch_size=4)
    result = dpo.train(start / "start", prepared, config, lora=LoRAConfig(rank=4, alpha=8.0), save_dir=tmp_path / "lora",
                       run_dir=tmp_path / "run", **QUIET)
    losses = [s["loss"] for s in result["steps"]]
    assert abs(losses[0] - math.log(2)) < 1e-6 and losses[-1] < losses[0]
    assert checkpoint.read_state(result["checkpoint"])["lora_base"]["path"] == str(start / "start")


@pytest.fixture(scope="module")
def others(start):
    """Two policies a set prepared on `start` does not fit: another width, and the same model whose tokenizer maps two
    tokens to each other's ids."""
    import json
    import shutil

    from pai_cookbook import convert
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    other, retokenized = start / "other", start / "retokenized"
    convert.hf_to_megatron(make_tiny_hf_model("llama", start / "other_hf", hidden_size=48), other)
    shutil.copytree(start / "start", retokenized)
    path = retokenized / checkpoint.HF_ASSETS / "tokenizer.json"
    content = json.loads(path.read_text())
    vocab = content["model"]["vocab"]
    first, second = sorted(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(content))
    return other, retokenized


def test_refused_before_launch(start, prepared, others, tmp_path, no_launch):
    """Pairs whose chosen equals rejected, an answer cut to nothing, a policy of another model or another tokenizer, a
    folder holding something else: refused by name before any worker starts."""

    same = [{"prompt": "Sort: 2 1", "chosen": "1 2", "rejected": "1 2 "}]
    with pytest.raises(ConfigError, match="chosen and rejected are the same text"):
        dpo.prepare(same, tmp_path / "set", start / "start")
    long = [{"prompt": "Sort: " + "9 " * 40, "chosen": "9", "rejected": "8"}]
    with pytest.raises(ConfigError, match="leaves none of the chosen answer"):
        dpo.prepare(long, tmp_path / "set", start / "start", max_length=40)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a prepared preference set"):
        dpo.prepare(same, tmp_path / "busy", start / "start")
    other, retokenized = others
    with pytest.raises(ConfigError, match="another model than the reference"):
        dpo.train(other, prepared, dpo.DPOConfig(steps=1))
    with pytest.raises(ConfigError, match="another tokenizer"):
        dpo.train(retokenized, prepared, dpo.DPOConfig(steps=1))
    with pytest.raises(ConfigError, match="not a prepared preference set"):
        dpo.train(start / "start", tmp_path, dpo.DPOConfig(steps=1))
    with pytest.raises(ConfigError, match="label_smoothing"):
        dpo.DPOConfig(loss="ipo", label_smoothing=0.1)


def test_adam_is_set_from_the_config(start, prepared):
    """Adam's betas and eps reach the run (TRL and torch default to beta2 0.999, the cookbook to Megatron-LM's 0.95);
    `hf_baseline.trl_dpo` hands TRL the same three, so the TRL comparison runs with whichever is set."""
    job = dpo.job_for(start / "start", prepared, dpo.DPOConfig(steps=1, adam_beta1=0.8, adam_beta2=0.999, adam_eps=1e-6))
    assert (job.run.optimizer.adam_beta1, job.run.optimizer.adam_beta2, job.run.optimizer.adam_eps) == (0.8, 0.999, 1e-6)
    default = dpo.job_for(start / "start", prepared, dpo.DPOConfig(steps=1)).run.optimizer
    assert (default.adam_beta1, default.adam_beta2, default.adam_eps) == (0.9, 0.95, 1e-8)


def test_held_out_pairs_left_over_are_said(capsys):
    """Held-out pairs run in whole micro-batches on every data-parallel rank; those left over are said before launch
    (they were dropped without a word), and a set that fills none is refused."""
    from pai_cookbook.core.launching.jobs import check_held_out_pairs
    from tests.conftest import tiny_run

    check_held_out_pairs(10, 4, tiny_run(), world_size=1)
    assert "8 of 10 are scored (whole micro-batches of 4 pairs on each of 1 data-parallel ranks); the last 2 are not" \
        in capsys.readouterr().out
    check_held_out_pairs(16, 4, tiny_run(), world_size=2)  # 2 ranks x 4: all of them
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="3 held-out pairs fill no micro-batch"):
        check_held_out_pairs(3, 4, tiny_run(), world_size=1)
