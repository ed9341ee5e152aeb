"""Reward models on Megatron-Core: the scalar head learns a preference, TP=2 trains the same model, the Hugging
Face export scores as the Megatron-Core model does, and bad pairs are refused before launch.

Two launches: 30 steps at TP=1 on a tiny Llama, the same 30 steps at TP=2. The preference is learnable by a
random tiny model in seconds (the chosen completion ends in "yes", the rejected one in "nah": the same length,
so only content tells them apart); the notebook's preference task (sorted against unsorted digits) is harder.
"""

import math
import random
from pathlib import Path

import pytest
import torch

from pai_cookbook import convert, generate, reward_model, rlhf
from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import ConfigError, ParallelConfig
from pai_cookbook.core.rl import rl_math as rl
from pai_cookbook.core.text import tokenizer

WORDS = "the a model data token layer train python code test".split()


def _pairs(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
        out.append({"prompt": " ".join(rng.choice(WORDS) for _ in range(3)), "chosen": f"{body} yes",
                    "rejected": f"{body} nah"})
    return out


PAIRS, VALID = _pairs(256, 0), _pairs(32, 1)
CONFIG = reward_model.RewardModelConfig(steps=30, lr=1e-3, global_batch_size=8, micro_batch_size=4, eval_interval=10,
                                        seed=5)


@pytest.fixture(scope="module")
def llama(converted):
    return converted["llama"][1]


@pytest.fixture(scope="module")
def trained(llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reward_model")
    result = reward_model.train(llama, PAIRS, CONFIG, valid=VALID, save_dir=folder / "rm", run_dir=folder / "run",
                                show_progress=False, echo=False)
    return result, folder


@pytest.mark.multiproc
def test_reward_model_learns_the_preference(trained):
    result, folder = trained
    losses = [s["loss"] for s in result["steps"]]
    assert len(losses) == CONFIG.steps == len(rlhf.history(folder / "run")["loss"])
    assert losses[0] > 0.6 and sum(losses[-5:]) / 5 < 0.2, losses  # log 2 = 0.69 at the start
    assert [v["step"] for v in result["valid"]] == [10, 20, 30]
    assert result["valid"][-1]["accuracy"] >= 0.9 > reward_model.length_baseline(VALID), result["valid"]
    # the held-out loss the worker reports is Bradley-Terry's over the scores it returns
    scores = result["valid_scores"]
    assert len(scores["chosen"]) == len(VALID)
    bt = sum(math.log1p(math.exp(r - c)) for c, r in zip(scores["chosen"], scores["rejected"])) / len(VALID)
    assert abs(bt - result["valid"][-1]["loss"]) < 1e-5
    assert checkpoint.head(result["checkpoint"]) == "reward"


@pytest.mark.multiproc
def test_a_finished_run_asked_again_returns_its_checkpoint_and_held_out_figures(trained, llama):
    """Re-running a notebook cell: no step runs, and the result still names the checkpoint and scores the
    held-out pairs with it (the same scores the last evaluation gave)."""
    result, folder = trained
    again = reward_model.train(llama, PAIRS, CONFIG, valid=VALID, save_dir=folder / "rm", run_dir=folder / "again",
                               show_progress=False, echo=False)
    assert again["steps"] == [] and again["checkpoint"] == result["checkpoint"]
    assert again["valid"][0]["accuracy"] == result["valid"][-1]["accuracy"]
    assert again["valid_scores"]["chosen"] == pytest.approx(result["valid_scores"]["chosen"], abs=1e-6)


@pytest.mark.multiproc
def test_a_run_driven_to_nan_stops_at_that_step_and_saves_nothing(llama, tmp_path):
    """As a training run (tests/test_work_never_lost.py): at a rate no weight survives (1e30) the second step is not
    finite (its loss or gradient norm), and the run stops there, names it and the last finite checkpoint, and saves
    nothing."""
    from pai_cookbook.core.launching.launch import WorkerError

    config = reward_model.RewardModelConfig(steps=4, lr=1e30, global_batch_size=8, micro_batch_size=4)
    with pytest.raises(WorkerError, match=r"step 2: the loss is \S+ and the gradient norm \S+; the run stops here"):
        reward_model.train(llama, PAIRS, config, save_dir=tmp_path / "rm", run_dir=tmp_path / "run",
                           show_progress=False, echo=False)
    assert checkpoint.finished_iterations(tmp_path / "rm") == []
    assert len(rlhf.history(tmp_path / "run")["loss"]) == 2


@pytest.mark.multiproc
@pytest.mark.parametrize("parallel", [ParallelConfig(tensor_model_parallel_size=2),
                                      ParallelConfig(pipeline_model_parallel_size=2)], ids=["tp2", "pp2"])
def test_two_process_layouts_train_the_reward_model_one_process_does(trained, llama, parallel, tmp_path):
    """TP=2: the scalar head is replicated on both ranks. PP=2: the first stage has no head, the loss and the
    held-out scores live on the last. Measured: losses within 4.5e-8 (TP=2) and 1.5e-8 (PP=2) of one process,
    held-out scores within 3.6e-7."""
    result, _ = trained
    two = reward_model.train(llama, PAIRS, CONFIG, valid=VALID, parallel=parallel, nproc_per_node=2, run_dir=tmp_path,
                             show_progress=False, echo=False)
    one_losses, two_losses = [s["loss"] for s in result["steps"]], [s["loss"] for s in two["steps"]]
    assert max(abs(a - b) for a, b in zip(one_losses, two_losses)) < 1e-4, (one_losses, two_losses)
    for side in ("chosen", "rejected"):
        one_scores, two_scores = result["valid_scores"][side], two["valid_scores"][side]
        assert len(two_scores) == len(VALID) and max(abs(a - b) for a, b in zip(one_scores, two_scores)) < 1e-4


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    result, _ = trained
    out = tmp_path_factory.mktemp("reward_model_hf") / "hf"
    convert.megatron_to_hf(result["checkpoint"], out)
    return AutoModelForSequenceClassification.from_pretrained(out).eval(), out


@pytest.mark.multiproc
def test_exported_reward_model_scores_as_megatron_core(trained, exported):
    """transformers' ...ForSequenceClassification of the export, on right-padded batches, reads the same score
    (measured: 3.6e-7)."""
    result, _ = trained
    model, out = exported
    assert model.config.architectures == ["LlamaForSequenceClassification"] and model.config.num_labels == 1
    hf = tokenizer.load(out)
    eos = tokenizer.eos_ids(out, hf)[0]
    assert hf.pad_token_id == model.config.pad_token_id != eos
    rows = [ids for pair in VALID for ids in reward_model.encode_pair(hf, pair, eos, "auto")]
    width = max(map(len, rows))
    ids = torch.tensor([r + [hf.pad_token_id] * (width - len(r)) for r in rows])
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=(ids != hf.pad_token_id).long()).logits[:, 0]
    megatron = torch.tensor([s for pair in zip(result["valid_scores"]["chosen"], result["valid_scores"]["rejected"])
                             for s in pair])
    assert (scores - megatron).abs().max() < 1e-5, (scores[:4], megatron[:4])


@pytest.mark.multiproc
def test_ppo_against_the_reward_model(trained, exported, llama, tmp_path):
    """PPO with the reward model as its reward and its critic's start: every completion's reward is the reward
    model's score at its last token (the exported model's, measured within 1e-6), the held-out evaluation
    scores what it sampled, and the run saves the policy with its KL coefficient and the critic beside it."""
    result, _ = trained
    model, out = exported
    config = rlhf.PPOConfig(steps=2, prompts_per_step=4, group_size=2, max_new_tokens=8, lr=1e-4, micro_batch_size=4,
                            kl_target=1.0, kl_horizon=8, seed=2)
    prompts = [{"prompt": p["prompt"]} for p in VALID[:8]]
    run = rlhf.ppo(llama, prompts, result["checkpoint"], config, eval_prompts=prompts[:2], save_dir=tmp_path / "ppo",
                   run_dir=tmp_path / "run", show_progress=False, echo=False)
    hf = tokenizer.load(out)
    rollouts = rlhf.read_rollouts(tmp_path / "run")
    rows = [tokenizer.encode(hf, prompts[r["prompt"]], "auto") + r["tokens"] for r in rollouts]
    with torch.no_grad():
        scores = [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in rows]
    assert max(abs(a - r["reward"]) for a, r in zip(scores, rollouts)) < 1e-4
    assert [s["reward"] for s in run["steps"]] == pytest.approx(
        [sum(r["reward"] for r in rollouts if r["step"] == step) / config.rows for step in range(2)])
    final = run["evals"][-1]
    assert final["step"] == 2 and final["reward"] == pytest.approx(
        sum(c["reward"] for c in final["completions"]) / len(final["completions"]))
    saved = Path(run["checkpoint"])
    assert checkpoint.head(saved) == "lm" and checkpoint.head(tmp_path / "ppo" / rlhf.CRITIC / saved.name) == "reward"
    controller = rl.AdaptiveKL(coef=config.kl_coef, target=config.kl_target, horizon=config.kl_horizon)
    for step in run["steps"]:
        controller.update(step["kl_sequence"], config.rows)
    assert checkpoint.read_state(saved)["kl_coef"] == pytest.approx(controller.coef, rel=1e-12)


@pytest.mark.multiproc
def test_language_model_code_refuses_a_reward_model(trained, no_launch):
    result, _ = trained
    with pytest.raises(ConfigError, match="is a reward model"):
        generate.generate(result["checkpoint"], ["the model"])
    with pytest.raises(ConfigError, match="is a reward model"):
        rlhf.grpo(result["checkpoint"], ["the model"], "tests.workers.rewards:brevity")


@pytest.mark.parametrize("change, message", [
    ({"rejected": "same"}, "pair 2 .* chosen and rejected are the same text"),
    ({"prompt": " "}, "pair 2 has an empty prompt"),
    ({"rejected": None}, "pair 2 .*'rejected' must be a non-empty string"),
    ({"margin": float("nan")}, "pair 2: margin nan"),
])
def test_bad_pairs_are_refused_before_launch(llama, change, message, no_launch):
    pairs = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "same", "rejected": "c"} | change]
    with pytest.raises(ConfigError, match=message):
        reward_model.train(llama, pairs)


def test_too_few_held_out_pairs_are_refused(llama, no_launch):
    with pytest.raises(ConfigError, match="3 held-out pairs fill no micro-batch of 4 pairs"):
        reward_model.train(llama, PAIRS, CONFIG, valid=VALID[:3])


def test_sequence_parallel_is_refused(llama, no_launch):
    with pytest.raises(ConfigError, match="without sequence parallelism"):
        reward_model.train(llama, PAIRS, parallel=ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                           nproc_per_node=2)


def test_sorting_pairs_differ_in_content_not_length():
    from pai_cookbook import rewards, tasks

    pairs = tasks.sorting_pairs(500, seed=2)
    assert all(len(p["chosen"]) == len(p["rejected"]) and p["chosen"] != p["rejected"] for p in pairs)
    assert all(rewards.exact_answer(p["chosen"], p) == 1.0 > rewards.exact_answer(p["rejected"], p) for p in pairs)
    assert reward_model.length_baseline(pairs) == 0.5
    copied = [c for c in tasks.sorting_sft(1000, seed=0, copy_share=0.5)
              if c["messages"][1]["content"] != " ".join(sorted(c["messages"][0]["content"][6:].split()))]
    assert 400 < len(copied) < 600  # about half answer unsorted (fewer: some questions come sorted already)


@pytest.mark.multiproc
def test_a_tokenizer_whose_only_special_token_is_its_end_is_refused_before_the_export(trained, tmp_path):
    """GPT-2's layout (begin, end and unknown all `<|endoftext|>`, no pad): no token can pad an exported
    ...ForSequenceClassification (an ordinary one named the pad token would become special and change old text), so
    the export is refused with the way through before any tensor is converted (it used to fail after all of them)."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    result, _ = trained
    ckpt = tmp_path / "rm"
    shutil.copytree(result["checkpoint"], ckpt)
    assets = ckpt / checkpoint.HF_ASSETS
    for name in tokenizer.FILES:
        (assets / name).unlink(missing_ok=True)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    backend.train_from_iterator(["the reward model scores answers"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    end = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=end, eos_token=end, unk_token=end).save_pretrained(assets)
    with pytest.raises(ConfigError, match=r"no special token but its end token\(s\) \[[\d, ]+\].*add_special_tokens"):
        convert.megatron_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not checkpoint.partial_dir(tmp_path / "hf").exists()
