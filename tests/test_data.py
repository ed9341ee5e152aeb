"""Data preparation: Megatron-Core indexed datasets that read back exactly, and specific errors."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from pai_cookbook import data, train
from pai_cookbook.core.checkpoints import families
from pai_cookbook.core.configs.config import DataConfig, RunConfig
from pai_cookbook.core.text.tokenizer import TOKENIZER_CORPUS, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(256).save_pretrained(folder)
    return folder


def test_prepared_dataset_reads_back_the_tokenizer_ids(tmp_path, tokenizer_dir):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [{"text": "Tensor parallelism splits each weight matrix."}, {"text": "语言模型预测下一个词。"}, {"text": ""}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(d, ensure_ascii=False) for d in docs) + "\n")
    summary = data.prepare([tmp_path / "in.jsonl", TOKENIZER_CORPUS], tmp_path / "ds", tokenizer_dir, show_progress=False)
    paragraphs = list(data.read_documents(TOKENIZER_CORPUS))
    assert summary["documents"] == 2 + len(paragraphs)  # the empty text is skipped
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    dataset = IndexedDataset(str(tmp_path / "ds"))
    expected = [tokenizer(d["text"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for d in docs[:2]]
    assert [list(dataset[i]) for i in range(2)] == expected
    assert summary["tokens"] == sum(len(dataset[i]) for i in range(len(dataset)))
    assert data.describe(tmp_path / "ds")["vocab_size"] == 256


def test_prepare_imports_megatron_core_without_torchinductor(tmp_path, tokenizer_dir):
    # data.prepare runs in the caller's process (a notebook kernel): on CPU Megatron-Core is imported there as the
    # workers import it, without the TorchInductor that its torch.compile-wrapped fusions pull in (1.6 s)
    if torch.cuda.is_available():
        pytest.skip("with CUDA Megatron-Core is imported as it is, fusions compiled")
    code = ("import sys; from pai_cookbook import data; "
            f"data.prepare([{str(TOKENIZER_CORPUS)!r}], {str(tmp_path / 'ds')!r}, {str(tokenizer_dir)!r}, "
            "show_progress=False); "
            "print('megatron.core' in sys.modules, 'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "False"]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "broken\n', r"in.jsonl:2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"in.jsonl:2: no field 'text' \(found \['body'\]\); set text_field"),
    ("", r"in.jsonl has no documents"),
])
def test_bad_jsonl_is_explained_with_the_line(tmp_path, tokenizer_dir, content, message):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(data.DataError, match=message):
        data.prepare([tmp_path / "in.jsonl"], tmp_path / "ds", tokenizer_dir, show_progress=False)
    assert not (tmp_path / "ds.bin").exists()


def test_unknown_format_and_missing_file(tmp_path, tokenizer_dir):
    (tmp_path / "in.csv").write_text("a,b\n")
    with pytest.raises(data.DataError, match=r"suffix '.csv'; the cookbook reads .jsonl and .txt"):
        data.prepare([tmp_path / "in.csv"], tmp_path / "ds", tokenizer_dir, show_progress=False)
    with pytest.raises(data.DataError, match=r"does not exist"):
        data.prepare([tmp_path / "nope.jsonl"], tmp_path / "ds", tokenizer_dir, show_progress=False)


def _indexed(paths, vocab_size=256):
    return RunConfig(model=families.tiny("llama", vocab_size=vocab_size),
                     data=DataConfig(source="indexed", paths=[str(p) for p in paths], seq_length=32))


def test_training_refuses_missing_or_foreign_datasets_before_launch(tmp_path, tokenizer_dir):
    with pytest.raises(data.DataError, match=r"dataset .*missing has no missing.bin; prepare it"):
        train.run(_indexed([tmp_path / "missing"]), run_dir=tmp_path / "run")
    data.prepare([TOKENIZER_CORPUS], tmp_path / "ds", tokenizer_dir, show_progress=False)
    with pytest.raises(data.DataError, match=r"tokenized with a 256-token vocabulary .* larger than the model's 128"):
        train.run(_indexed([tmp_path / "ds"], vocab_size=128), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_weighted_blend_draws_from_every_dataset_by_weight(tmp_path, tokenizer_dir):
    import collections

    from pai_cookbook import data
    for name in ("a", "b"):
        data.prepare([TOKENIZER_CORPUS], tmp_path / name, tokenizer_dir, show_progress=False)
    config = RunConfig(model=families.tiny("llama"), train_iters=50, data=DataConfig(
        source="indexed", paths=[str(tmp_path / "a"), str(tmp_path / "b")], weights=[0.75, 0.25], seq_length=16,
        micro_batch_size=2, global_batch_size=8, split="80,20,0"))
    data.check_for_training(config)
    import torch.distributed as dist

    from pai_cookbook.core.machine.runtime import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:  # Megatron-Core's dataset builder asks the process group which rank builds
        train_set, valid_set = data.build_datasets(config, eval_batches=2)
    finally:
        dist.destroy_process_group()
    assert len(train_set) >= 50 * 8 and len(valid_set) >= 2 * 8
    counts = collections.Counter(int(i) for i in train_set.dataset_index[:400])
    assert abs(counts[0] / 400 - 0.75) < 0.02 and abs(counts[1] / 400 - 0.25) < 0.02  # Megatron's exact blending


def test_an_empty_split_is_refused_before_megatron_loops_on_it(tmp_path, tokenizer_dir):
    data.prepare([TOKENIZER_CORPUS], tmp_path / "ds", tokenizer_dir, show_progress=False)  # 11 documents
    config = RunConfig(model=families.tiny("llama"), data=DataConfig(source="indexed", paths=[str(tmp_path / "ds")],
                                                                     seq_length=16, split="98,2,0"))
    with pytest.raises(data.DataError, match=r"has 11 documents; split '98,2,0' leaves the validation split empty"):
        train.run(config, run_dir=tmp_path / "run")
    assert data.split_documents(11, "80,20,0") == [9, 2, 0]


def test_a_dataset_from_another_tokenizer_of_the_same_size_is_refused(tmp_path, tokenizer_dir):
    from pai_cookbook import convert
    from pai_cookbook.core.configs.config import CheckpointConfig
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("llama", tmp_path / "hf")
    convert.hf_to_megatron(hf, tmp_path / "ckpt")
    other = tmp_path / "other_tok"  # also 256 tokens, trained on different text
    (tmp_path / "other.txt").write_text("completely different text for another vocabulary " * 50)
    make_tokenizer(256, corpus=tmp_path / "other.txt").save_pretrained(other)
    data.prepare([TOKENIZER_CORPUS], tmp_path / "ds", other, show_progress=False)
    config = _indexed([tmp_path / "ds"])
    config.data.split = "80,20,0"
    config.checkpoint = CheckpointConfig(load_dir=str(tmp_path / "ckpt"))
    with pytest.raises(data.DataError, match=r"not with the tokenizer of .*ckpt \(their vocabulary files differ\)"):
        train.run(config, run_dir=tmp_path / "run")
    data.prepare([TOKENIZER_CORPUS], tmp_path / "ds", tmp_path / "ckpt" / "hf_assets", show_progress=False)
    data.check_for_training(config)  # the checkpoint's own tokenizer passes


def test_a_checkpoint_trained_from_scratch_carries_the_datasets_tokenizer(tmp_path, tokenizer_dir):
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.core.configs.config import CheckpointConfig
    from pai_cookbook.core.text import tokenizer

    data.prepare([TOKENIZER_CORPUS], tmp_path / "ds", tokenizer_dir, show_progress=False)
    config = _indexed([tmp_path / "ds"])
    config.data.split = "80,20,0"
    config.train_iters = 1
    config.checkpoint = CheckpointConfig(save_dir=str(tmp_path / "ckpt"))
    saved = train.run(config, run_dir=tmp_path / "run", show_progress=False, echo=False)["checkpoint"]
    assets = tmp_path / "ckpt" / "iter_0000001" / checkpoint.HF_ASSETS
    assert saved == str(assets.parent)
    # the same vocabulary as the dataset's; no config.json, which would describe another model
    assert tokenizer.fingerprint(assets) == data.describe(tmp_path / "ds")["tokenizer_sha256"]
    assert not (assets / "config.json").exists()


@pytest.mark.parametrize("killed_after", [1, 2], ids=["between-bin-and-idx", "before-the-sidecar"])
def test_a_re_preparation_killed_while_publishing_leaves_a_dataset_that_is_refused(tmp_path, tokenizer_dir,
                                                                                  monkeypatch, killed_after):
    """Re-preparing a dataset with other text, killed after `killed_after` of its renames: the files left are never
    read as a dataset (the old sidecar would otherwise describe the new .bin with the old .idx, or new files)."""
    prefix = tmp_path / "corpus"
    for name, text in (("a.jsonl", "hello world"), ("b.jsonl", "another text, longer than the first one")):
        (tmp_path / name).write_text("\n".join(json.dumps({"text": f"{text} {i}"}) for i in range(40)) + "\n")
    data.prepare([tmp_path / "a.jsonl"], prefix, tokenizer_dir, show_progress=False)
    assert data.describe(prefix)["documents"] == 40
    renames = []

    def replace(src, dst):
        if len(renames) == killed_after:
            raise KeyboardInterrupt  # the kernel interrupted between two renames
        renames.append(dst)
        return real_replace(src, dst)

    real_replace = data.os.replace
    monkeypatch.setattr(data.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        data.prepare([tmp_path / "b.jsonl"], prefix, tokenizer_dir, show_progress=False)
    monkeypatch.undo()
    with pytest.raises(data.DataError, match=r"has no corpus.json; prepare it with data.prepare.*interrupted"):
        data.describe(prefix)
    # an old sidecar left beside files it does not describe (a copy of the folder taken mid-way) is refused too
    (tmp_path / "corpus.json").write_text(json.dumps({"tokens": 1, "bin_bytes": 1, "idx_sha256": "0"}))
    with pytest.raises(data.DataError, match=r"corpus.bin/.idx are not the files its sidecar corpus.json describes"):
        data.describe(prefix)
    data.prepare([tmp_path / "b.jsonl"], prefix, tokenizer_dir, show_progress=False)
    assert data.describe(prefix)["documents"] == 40
