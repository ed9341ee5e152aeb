"""Every public entry point that takes a checkpoint takes a training run's save folder too, resolved once
(`checkpoint.resolve`) to its latest finished iteration, which is what its worker is handed.

The save folder here holds an older iteration whose description differs (fewer positions), the latest one, and two
later unfinished ones (a `.partial` write and a folder without `pai_cookbook.json`), so an entry point that reads the
wrong one, or none, fails. No worker starts: `launch.launch` (and `launch.run_here`, which runs a small conversion in
the caller's process) is replaced by one that records the job it was handed."""

import dataclasses
import json
import shutil

import pytest

from pai_cookbook import convert, dpo, evaluate, extend, generate, harness, lora, moe, parity, reward_model, rlhf, train
from pai_cookbook.core.checkpoints import checkpoint, checkpoint_config
from pai_cookbook.core.configs.config import CheckpointConfig, ConfigError, ParallelConfig, RunConfig
from pai_cookbook.core.configs.generation import GenerationConfig
from pai_cookbook.core.launching import launch
from tests.conftest import tiny_run


class Launched(Exception):
    """What the stand-in launcher raises once it has recorded the job."""


@pytest.fixture(scope="module")
def folders(converted, tmp_path_factory):
    hf, ckpt, _ = converted["llama"]
    root = tmp_path_factory.mktemp("resolve")
    save = root / "checkpoints"
    older, latest = save / "iter_0000009", save / "iter_0000010"
    shutil.copytree(ckpt, older)
    description = json.loads((older / checkpoint.CONFIG_FILE).read_text())
    description["model"]["max_position_embeddings"] //= 2  # an older iteration that is told from the latest
    (older / checkpoint.CONFIG_FILE).write_text(json.dumps(description))
    shutil.copytree(ckpt, latest)
    shutil.copytree(ckpt, save / "iter_0000011.partial")
    (save / "iter_0000012").mkdir()
    adapters = root / "lora"  # a LoRA run's save folder: iterations naming their base
    for step in (3, 4):
        shutil.copytree(ckpt, adapters / f"iter_{step:07d}")
        path = adapters / f"iter_{step:07d}" / checkpoint.CONFIG_FILE
        description = json.loads(path.read_text())
        description["state"] = {"lora_base": {"path": str(ckpt), "identity": checkpoint_config.identity(ckpt)}}
        path.write_text(json.dumps(description))
    return {"hf": hf, "save": save, "latest": latest, "adapters": adapters, "root": root}


def test_resolve_picks_the_latest_finished_iteration(folders):
    assert checkpoint.resolve(folders["save"]) == folders["latest"]
    assert checkpoint.resolve(folders["latest"]) == folders["latest"]  # a checkpoint is itself
    assert evaluate.max_length(folders["save"]) == evaluate.max_length(folders["latest"])
    assert evaluate.max_length(folders["save"]) != evaluate.max_length(folders["save"] / "iter_0000009")


@pytest.mark.parametrize("case", ["missing", "empty", "unfinished", "partial"])
def test_resolve_says_what_the_folder_holds(folders, case, tmp_path):
    path = {"missing": tmp_path / "nowhere", "empty": tmp_path, "partial": folders["save"] / "iter_0000011.partial",
            "unfinished": tmp_path / "run"}[case]
    if case == "unfinished":
        (path / "iter_0000001").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as error:
        checkpoint.resolve(path)
    said = {"missing": "it does not exist", "empty": "it holds no iter_* folder", "partial": "unfinished write",
            "unfinished": "iter_0000001 is unfinished"}[case]
    assert said in str(error.value) and "not a checkpoint written by the cookbook, nor a training save folder" in str(
        error.value)


def _prompts(path):
    path.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return path


# a chat template whose turns end with the tiny tokenizer's end of text
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}\n"
         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


# Each public entry point that takes a checkpoint, called with the save folder (s) and a scratch folder (o).
CALLS = {
    "evaluate.loglikelihood": lambda f, s, o: evaluate.loglikelihood(s, [("one two", " three")], run_dir=o),
    "evaluate.loglikelihood_tokens": lambda f, s, o: evaluate.loglikelihood_tokens(s, [([1, 2], [3])], run_dir=o),
    "evaluate.perplexity": lambda f, s, o: evaluate.perplexity(s, ["one two three"], run_dir=o),
    "evaluate.generate_until": lambda f, s, o: evaluate.generate_until(s, [("one", ["\n"])], max_new_tokens=4,
                                                                       run_dir=o),
    "generate.generate": lambda f, s, o: generate.generate(s, [{"prompt": "hello"}], GenerationConfig(max_new_tokens=4),
                                                           run_dir=o),
    "generate.generate_file": lambda f, s, o: generate.generate_file(s, _prompts(o.parent / "p.jsonl"), o.parent / "c.jsonl",
                                                                     GenerationConfig(max_new_tokens=4), run_dir=o),
    "convert.megatron_to_hf": lambda f, s, o: convert.megatron_to_hf(s, o.parent / "hf", run_dir=o),
    "convert.reshard": lambda f, s, o: convert.reshard(s, o.parent / "resharded", ParallelConfig(), run_dir=o),
    "parity.check": lambda f, s, o: parity.check(f["hf"], s, run_dir=o),
    "moe.upcycle": lambda f, s, o: moe.upcycle(s, o.parent / "moe", num_experts=4, run_dir=o),
    "extend.score": lambda f, s, o: extend.score([s], {"text": ["one two"]}, run_dir=o),
    "dpo.prepare": lambda f, s, o: dpo.prepare([{"prompt": "a", "chosen": "b", "rejected": "c"}], o.parent / "pairs", s,
                                               template=PLAIN, run_dir=o),
    "dpo.kl_to_reference": lambda f, s, o: dpo.kl_to_reference(s, s, ["hello"], samples=1, max_new_tokens=2, run_dir=o),
    "reward_model.train": lambda f, s, o: reward_model.train(s, [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2,
                                                             run_dir=o, save_dir=o.parent / "rm"),
    "rlhf.sampled_reward": lambda f, s, o: rlhf.sampled_reward(s, [{"prompt": "hello"}],
                                                               "pai_cookbook.rewards:positional_match", run_dir=o),
    "train.run (RunConfig.from_checkpoint)": lambda f, s, o: train.run(
        RunConfig.from_checkpoint(s, train_iters=1, data=tiny_run().data), run_dir=o),
    "train.run (checkpoint.load_dir)": lambda f, s, o: train.run(
        tiny_run(checkpoint=CheckpointConfig(load_dir=str(s)), train_iters=1), run_dir=o),
    "lora.merge": lambda f, s, o: lora.merge(f["adapters"], o.parent / "merged", run_dir=o),
    "lora.export_peft": lambda f, s, o: lora.export_peft(f["adapters"], o.parent / "peft", run_dir=o),
}


@pytest.mark.parametrize("name", CALLS)
def test_every_entry_point_hands_its_worker_the_latest_iteration(name, folders, tmp_path, monkeypatch):
    handed = []

    def record(job, *args, **kwargs):
        handed.append(job)
        raise Launched

    monkeypatch.setattr(launch, "launch", record)
    monkeypatch.setattr(launch, "run_here", record)  # a conversion of a small model runs in this process
    with pytest.raises(Launched):
        CALLS[name](folders, folders["save"], tmp_path / "run")
    (job,) = handed
    text = json.dumps(dataclasses.asdict(job), default=str)
    latest = folders["adapters"] / "iter_0000004" if name.startswith("lora.") else folders["latest"]
    assert str(latest.resolve()) in text or str(latest) in text, text[:400]
    assert "iter_0000009" not in text and "iter_0000003" not in text and "iter_0000011" not in text


def test_the_harness_model_and_the_tokenizer_read_the_latest(folders):
    model = harness.MegatronLM(ckpt=str(folders["save"]))
    assert model.ckpt == folders["latest"] and model.max_length == evaluate.max_length(folders["latest"])
    assert evaluate.tokenizer(folders["save"]).vocab_size == evaluate.tokenizer(folders["latest"]).vocab_size
    assert generate.resolve_checkpoint(folders["save"]) == folders["latest"]


def test_a_folder_that_is_neither_is_refused_before_launch(tmp_path, no_launch):
    with pytest.raises(FileNotFoundError, match="it holds no iter_\\* folder"):
        evaluate.perplexity(tmp_path, ["text"])
    with pytest.raises((FileNotFoundError, ConfigError), match="nor a training save folder"):
        convert.megatron_to_hf(tmp_path, tmp_path / "out")

