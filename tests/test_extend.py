"""Vocabulary extension: both merge paths keep old text as it was, compress Chinese, agree with
SentencePiece, and refuse what they cannot do before any worker starts. (Growth, TP parity and the
Hugging Face round trip run in notebook 02; the real model's KL and initialisation comparison in
test_real_model.py.)"""

from pathlib import Path

import pytest
import sentencepiece

from pai_cookbook import corpora, extend, tiny_models
from pai_cookbook.core import tokenizer, vocabulary
from pai_cookbook.core.config import ConfigError

LEARN = 5000  # Chinese sentences to learn from: ~105k characters, a few seconds of BPE learning


@pytest.fixture(scope="module")
def byte_level_base(tmp_path_factory) -> Path:
    """A 1,000-token byte-level BPE tokenizer (GPT-2 style) trained on English here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpora.english(), trainer)
    folder = tmp_path_factory.mktemp("byte_base")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sentencepiece_base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sp_base")
    model = vocabulary.train_sentencepiece(corpora.english(), 1000, vocabulary.LLAMA2_SETTINGS)
    vocabulary.sentencepiece_to_hf(model, folder, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    return folder


def _texts() -> list[str]:
    return corpora.EDGE_CASES + corpora.chinese("held_out", limit=500) + corpora.english(limit=300)


def _acceptance(base: Path, extended: Path) -> None:
    checks = extend.check_tokenizer(base, extended, _texts())
    # Issue acceptance: each of these counts is 0 on the edge cases and the held-back text.
    assert {k: v for k, v in checks.items() if k != "texts"} == {
        "old_ids_moved": 0, "specials_moved": 0, "changed_without_new": 0, "not_concatenation": 0,
        "roundtrip_failures": 0}
    held_out, english = corpora.chinese("held_out"), corpora.english()
    # Issue bounds: Chinese >= 1.8x fewer tokens on held-back text, English within 0.5%.
    assert extend.compression(base, held_out) / extend.compression(extended, held_out) >= 1.8
    assert abs(extend.compression(extended, english) / extend.compression(base, english) - 1) <= 0.005


def test_byte_level_extension_keeps_old_text_and_compresses_chinese(byte_level_base, tmp_path):
    extension = extend.extend_tokenizer(byte_level_base, corpora.chinese(limit=LEARN), tmp_path / "zh", 800)
    assert extension.kind == "byte_bpe" and extension.added == extension.learned - len(extension.dropped) > 700
    _acceptance(byte_level_base, tmp_path / "zh")
    # the mean initialisation's sources: each new token's text under the old tokenizer, >= 2 old tokens
    base = tokenizer.load(byte_level_base)
    extended = tokenizer.load(tmp_path / "zh")
    for new_id, old_ids in zip(range(extension.first_new, extension.size), extension.sources):
        assert len(old_ids) >= 2
        assert "".join(base.convert_ids_to_tokens(old_ids)) == extended.convert_ids_to_tokens(new_id)


def test_bpe_merges_are_deterministic_and_skip_existing_tokens(byte_level_base):
    backend = tokenizer.load(byte_level_base).backend_tokenizer
    texts = corpora.chinese(limit=1000)
    first = vocabulary.learn_bpe_merges(backend, texts, 200)
    assert first.pairs == vocabulary.learn_bpe_merges(backend, texts, 200).pairs  # ties broken by the pair
    vocab = backend.get_vocab()
    assert not any(token in vocab for token in first.tokens) and len(set(first.tokens)) == len(first.tokens)
    assert first.counts == sorted(first.counts, reverse=True)  # learned most frequent first


def test_sentencepiece_extension_agrees_with_the_fast_tokenizer(sentencepiece_base, tmp_path):
    extension = extend.extend_tokenizer(sentencepiece_base, corpora.chinese(limit=LEARN), tmp_path / "zh", 4000)
    assert extension.kind == "sentencepiece" and extension.added > 3000
    _acceptance(sentencepiece_base, tmp_path / "zh")
    fast = tokenizer.load(tmp_path / "zh")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "zh" / "tokenizer.model"))
    texts = _texts()
    # Issue acceptance: SentencePiece ids == fast-tokenizer ids, and decode(encode(x)) == x, on 100%.
    assert [processor.encode(t) for t in texts] == [fast(t, add_special_tokens=False).input_ids for t in texts]
    assert all(processor.decode(processor.encode(t)) == t for t in texts)
    # The copied merge (score 0) makes SentencePiece disagree with the fast tokenizer on the same pieces.
    pieces = fast.convert_ids_to_tokens(list(range(extension.first_new, extension.size)))
    zero = sentencepiece.SentencePieceProcessor(model_proto=vocabulary.append_pieces(
        (sentencepiece_base / "tokenizer.model").read_bytes(), pieces, zero_scores=True))
    assert sum(zero.encode(t) != fast(t, add_special_tokens=False).input_ids for t in texts) > 10


def test_refusals_before_any_work(byte_level_base, sentencepiece_base, tmp_path):
    # a tokenizer kind the cookbook cannot extend: the tiny Metaspace BPE (no byte level, no .model)
    tokenizer.tiny().save_pretrained(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="extends byte-level BPE"):
        extend.extend_tokenizer(tmp_path / "tiny", corpora.chinese(limit=100), tmp_path / "out", 10)
    # a corpus too small for the pieces asked for, on both paths
    with pytest.raises(ConfigError, match="fewer than half"):
        extend.extend_tokenizer(byte_level_base, corpora.chinese(limit=20), tmp_path / "out", 2000)
    with pytest.raises(ConfigError, match="at least"):
        extend.extend_tokenizer(sentencepiece_base, corpora.chinese(limit=2000), tmp_path / "out", 100)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_new_token_spelling_a_special_token_is_refused(byte_level_base, tmp_path):
    base = tokenizer.load(byte_level_base)
    base.add_special_tokens({"additional_special_tokens": ["天氣"]})
    base.save_pretrained(tmp_path / "base")
    texts = ["天氣"] * 50  # its five merges end in the token "天氣", which the special token already spells
    with pytest.raises(ConfigError, match="spell special tokens"):
        extend.extend_tokenizer(tmp_path / "base", texts, tmp_path / "out", 5)


def test_growing_a_checkpoint_of_another_tokenizer_is_refused(byte_level_base, tmp_path):
    from pai_cookbook import convert

    extend.extend_tokenizer(byte_level_base, corpora.chinese(limit=2000), tmp_path / "zh", 100)
    tiny_models.make_tiny_hf_model("llama", tmp_path / "hf")  # the 256-token tiny tokenizer, not byte_level_base
    convert.hf_to_megatron(tmp_path / "hf", tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="different tokenizer"):
        extend.grow(tmp_path / "ckpt", tmp_path / "zh", tmp_path / "grown")
    with pytest.raises(ConfigError, match="init"):
        extend.grow(tmp_path / "ckpt", tmp_path / "zh", tmp_path / "grown", init="zeros")
    assert not (tmp_path / "grown.logs").exists()  # refused before any worker was launched
