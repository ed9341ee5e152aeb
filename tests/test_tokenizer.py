"""The one tokenizer module: the tiny tokenizer is the same on every run, and a fingerprint tells
tokenizers apart."""

import pytest

from pai_cookbook import tiny_models
from pai_cookbook.core import tokenizer


def test_tiny_models_carry_the_same_tokenizer_every_time(tmp_path):
    # Trained afresh each time it differed from run to run (tokenizers breaks BPE ties in hash order).
    first = tiny_models.make_tiny_hf_model("llama", tmp_path / "a")
    second = tiny_models.make_tiny_hf_model("llama", tmp_path / "b")
    assert tokenizer.fingerprint(first) == tokenizer.fingerprint(second) is not None
    assert len(tokenizer.load(first)) == 256


def test_fingerprint_and_copy(tmp_path):
    tokenizer.make_tokenizer(200).save_pretrained(tmp_path / "other")
    tokenizer.tiny().save_pretrained(tmp_path / "tiny")
    assert tokenizer.fingerprint(tmp_path / "other") != tokenizer.fingerprint(tmp_path / "tiny")
    copied = tokenizer.copy(tmp_path / "tiny", tmp_path / "copy")
    assert "tokenizer.json" in copied and tokenizer.fingerprint(tmp_path / "copy") == tokenizer.fingerprint(tmp_path / "tiny")
    assert tokenizer.fingerprint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="carries no tokenizer"):
        tokenizer.load(tmp_path)
