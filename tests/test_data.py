"""Data preparation: Megatron-Core indexed datasets that read back exactly, and specific errors."""

import json

import pytest
import transformers

from pai_cookbook import data, families, train
from pai_cookbook.config import DataConfig, RunConfig
from pai_cookbook.tiny_models import TOKENIZER_CORPUS, make_tokenizer


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
