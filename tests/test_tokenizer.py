"""The one tokenizer module: the tiny tokenizer is the same on every run, and a fingerprint tells
tokenizers apart."""

import pytest

from pai_cookbook.core.text import tokenizer
from pai_cookbook.fixtures import tiny_models


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


def test_the_byte_level_tokenizer_round_trips_any_text_and_marks_chat_turns_with_one_token_each(tmp_path):
    from pai_cookbook import sft

    texts = ["Sort: 3 1 2", "héllo, 世界 🙂\n\ttabs  and  spaces"]
    chat = tokenizer.byte_level(sft.CHATML)
    chat.save_pretrained(tmp_path / "a")
    tokenizer.byte_level(sft.CHATML).save_pretrained(tmp_path / "b")
    assert tokenizer.fingerprint(tmp_path / "a") == tokenizer.fingerprint(tmp_path / "b")  # built, not trained
    loaded = tokenizer.load(tmp_path / "a")
    assert len(loaded) == 259 and loaded.eos_token == "<|im_end|>" and loaded.bos_token == "<|im_start|>"
    for text in texts:
        ids = loaded(text).input_ids
        assert len(ids) == len(text.encode()) and loaded.decode(ids) == text  # a token per byte, lossless
    rendered = loaded.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False,
                                          add_generation_prompt=True)
    ids = loaded(rendered, add_special_tokens=False).input_ids
    assert ids.count(loaded.bos_token_id) == 2 and ids.count(loaded.eos_token_id) == 1  # two turns opened, one closed
