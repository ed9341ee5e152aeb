"""Bad input from docs/bad-inputs.md that used to end in a raw traceback: each is refused, before any worker
starts, with a message that names the file (and line) and the fix. None of these tests launches a worker."""

import json
import struct

import pytest

from pai_cookbook import convert, data, moe, tiny_models
from pai_cookbook.core import checkpoint, families, tokenizer
from pai_cookbook.core.config import ConfigError, RunConfig
from tests.conftest import tiny_run


@pytest.fixture
def tiny_llama(tmp_path):
    return tiny_models.make_tiny_hf_model("llama", tmp_path / "llama")


def test_empty_or_misspelt_config_json(tiny_llama):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["num_hidden_layer"] = config.pop("num_hidden_layers")
    (tiny_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json has the key 'num_hidden_layer'.*did you mean 'num_hidden_layers'"):
        convert.inspect_hf(tiny_llama)
    (tiny_llama / "config.json").write_text("")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON \(0 bytes"):
        families.from_hf(tiny_llama)


def test_garbage_safetensors_header(tiny_llama):
    shard = sorted(tiny_llama.glob("model-*.safetensors"))[0]
    garbage = b"not json at all"
    shard.write_bytes(struct.pack("<Q", len(garbage)) + garbage + b"\0" * 64)
    with pytest.raises(ConfigError, match=rf"{shard.name} has a damaged safetensors header"):
        convert.inspect_hf(tiny_llama)


def test_a_folder_without_tokenizer_is_refused_unless_asked(tiny_llama, tmp_path):
    for name in tokenizer.FILES:
        (tiny_llama / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"has no tokenizer files.*require_tokenizer=False"):
        convert.hf_to_megatron(tiny_llama, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not checkpoint.partial_dir(tmp_path / "out").exists()


def test_output_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(FileExistsError, match=r"out is a file, not a folder"):
        checkpoint.check_writable(tmp_path / "out", overwrite=True)


def test_negative_loss_weights():
    with pytest.raises(ConfigError, match=r"moe_aux_loss_coeff -1.0 .* must be >= 0"):
        moe.upcycled_config(families.tiny("llama"), 4, moe_aux_loss_coeff=-1.0)


def test_run_config_files(tmp_path):
    path = tiny_run().save(tmp_path / "run.json")
    path.write_text(path.read_text()[:40])
    with pytest.raises(ConfigError, match=r"run.json is not valid JSON"):
        RunConfig.load(path)
    good = json.loads(tiny_run().to_json())
    good["data"]["seq_length"] = "32"
    path.write_text(json.dumps(good))
    with pytest.raises(ConfigError, match=r"DataConfig.seq_length must be int, got '32' \(str\)"):
        RunConfig.load(path)


def test_text_that_is_not_utf8_names_file_and_line(tmp_path):
    txt = tmp_path / "gbk.txt"
    txt.write_bytes(b"hello\n\n" + "天气".encode("gbk") + b"\n")
    with pytest.raises(data.DataError, match=r"gbk.txt:3: not UTF-8 text"):
        list(data.read_documents(txt))
    jsonl = tmp_path / "gbk.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n' + '{"text": "天气"}'.encode("gbk") + b"\n")
    with pytest.raises(data.DataError, match=r"gbk.jsonl:2: not UTF-8 text"):
        list(data.read_documents(jsonl))


def test_a_bad_line_mid_file_leaves_no_partial_dataset(tmp_path):
    tokenizer.tiny().save_pretrained(tmp_path / "tok")
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "hello world"}\n' * 100 + '{"text": 1\n')  # the 101st line is broken
    with pytest.raises(data.DataError, match=r"in.jsonl:101: not valid JSON"):
        data.prepare([corpus], tmp_path / "ds", tmp_path / "tok", show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "tok"]
