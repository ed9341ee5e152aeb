"""Vocabulary extension: both merge paths keep old text as it was, compress Chinese, agree with
SentencePiece, and refuse what they cannot do before any worker starts. (Growth, TP parity and the
Hugging Face round trip run in notebook 02; the real model's KL and initialisation comparison in
test_real_model.py.)"""

import re
from pathlib import Path

import pytest
import sentencepiece

from pai_cookbook import corpora, extend
from pai_cookbook.core.configs.config import ConfigError
from pai_cookbook.core.text import spm, tokenizer, vocabulary
from pai_cookbook.fixtures import tiny_models

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
    model = spm.train_sentencepiece(corpora.english(), 1000, spm.LLAMA2_SETTINGS)
    spm.sentencepiece_to_hf(model, folder, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
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
    zero = sentencepiece.SentencePieceProcessor(model_proto=spm.append_pieces(
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
    # English alone: no ASCII merge is learned, and the refusal says so (it said "0 new tokens" and no more)
    with pytest.raises(ConfigError, match=r"gives only 0 new tokens.*100% ASCII.*merges whose token holds a non-ASCII"):
        extend.extend_tokenizer(byte_level_base, corpora.english()[:200], tmp_path / "out", 100)
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


# --------------------------------------------------------------------------------------------------
# What real tokenizers hold and the small fixtures above did not (issue 37), each in a minimal case
# --------------------------------------------------------------------------------------------------
def _texts_with_specials(hf) -> list[str]:
    specials = sorted({t.content for t in hf.added_tokens_decoder.values()})
    return [f"{s}Hello world{s}" for s in specials] + [f"Hello {s} world" for s in specials]


def test_byte_level_specials_outside_the_vocabulary_keep_their_ids(byte_level_base, tmp_path):
    """Qwen's and Meta's Llama 3 tokenizer.json hold specials as added tokens only (not in model.vocab), at ids
    beyond the vocabulary and with gaps; `tokenizers` renumbers such tokens from len(vocab) when it loads a file."""
    import json
    import shutil

    data = json.loads((byte_level_base / "tokenizer.json").read_text())
    size = len(data["model"]["vocab"])
    for offset, name in ((0, "<|im_start|>"), (1, "<|im_end|>"), (3, "<tool_call>")):  # a gap at size + 2
        data["added_tokens"].append({"id": size + offset, "content": name, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    shutil.copytree(byte_level_base, tmp_path / "base")
    (tmp_path / "base" / "tokenizer.json").write_text(json.dumps(data))
    base = tokenizer.load(tmp_path / "base")
    extension = extend.extend_tokenizer(tmp_path / "base", corpora.chinese(limit=2000), tmp_path / "zh", 200)
    extended = tokenizer.load(tmp_path / "zh")
    assert extend.moved_specials(base, extended) == {}
    assert extension.first_new > max(base.get_vocab().values())
    texts = _texts_with_specials(base)
    assert [base(t).input_ids for t in texts] == [extended(t).input_ids for t in texts]


def test_new_scores_are_distinct_in_float32_and_below_every_old_score(sentencepiece_base):
    import numpy as np

    model = spm.model_proto((sentencepiece_base / "tokenizer.model").read_bytes())
    model.pieces[-1].score = -1e9  # Mistral's lowest score: a float32 step there is 64
    grown = spm.model_proto(spm.append_pieces(model.SerializeToString(), [f"新{i}" for i in range(500)]))
    new = np.array([p.score for p in grown.pieces[len(model.pieces):]], dtype=np.float32)
    assert len(set(new.tolist())) == 500 and (np.diff(new) < 0).all() and new.max() < np.float32(-1e9)


def test_sentencepiece_base_with_a_pad_token_beyond_its_pieces_is_extended(sentencepiece_base, tmp_path):
    base = tokenizer.load(sentencepiece_base)
    base.add_special_tokens({"pad_token": "[PAD]"})  # id 1000 = the model's piece count, as in Llama 2 fine-tunes
    base.save_pretrained(tmp_path / "base")
    tokenizer.copy(sentencepiece_base, tmp_path / "base", ("tokenizer.model",))
    extension = extend.extend_tokenizer(tmp_path / "base", corpora.chinese(limit=LEARN), tmp_path / "zh", 4000)
    extended = tokenizer.load(tmp_path / "zh")
    assert extended.convert_tokens_to_ids("[PAD]") == 1000 and extension.first_new == 1001
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "zh" / "tokenizer.model"))
    assert processor.id_to_piece(1000) == "[PAD]" and processor.get_piece_size() == extension.size
    texts = corpora.chinese("held_out", limit=200)
    assert [processor.encode(t) for t in texts] == [extended(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def mistral_like_base(tmp_path_factory) -> Path:
    """A SentencePiece model laid out as Mistral's: whitespace runs right after the bytes (low ids) with score
    -1e9, 300 control symbols, and the Hugging Face tokenizer transformers makes from it (what a user loads)."""
    import json

    from transformers import AutoTokenizer

    settings = spm.LLAMA2_SETTINGS | {"control_symbols": [f"[control_{i}]" for i in range(300)]}
    model = spm.model_proto(spm.train_sentencepiece(corpora.english(), 1300, settings))
    pieces = list(model.pieces)
    runs = [p for p in pieces if set(p.piece) == {"\u2581"} and len(p.piece) > 1]
    present = {p.piece for p in runs}
    for width in (2, 3, 4, 8):
        if "\u2581" * width not in present:
            runs.append(type(pieces[0])(piece="\u2581" * width, score=0.0, type=model.SentencePiece.NORMAL))
    for run in runs:
        run.score = -1e9
    head = [p for p in pieces if p.type != model.SentencePiece.NORMAL]
    del model.pieces[:]
    model.pieces.extend(head + runs + [p for p in pieces if p.type == model.SentencePiece.NORMAL and p not in runs])
    folder = tmp_path_factory.mktemp("mistral_like")
    (folder / "tokenizer.model").write_bytes(model.SerializeToString())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    return folder


def test_mistral_like_base_keeps_indented_text_and_special_tokens(mistral_like_base, tmp_path):
    """Whitespace pieces at low ids and special tokens typed in text: old text keeps the base's ids, in the
    Hugging Face tokenizer and in SentencePiece."""
    extension = extend.extend_tokenizer(mistral_like_base, corpora.chinese(limit=LEARN), tmp_path / "zh", 4000)
    assert extension.added > 3000
    base, extended = tokenizer.load(mistral_like_base), tokenizer.load(tmp_path / "zh")
    english = corpora.english(limit=200)
    indented = [indent + text for indent in ("    ", "        ", "  ", "\t") for text in english]
    texts = indented + ["def f():\n    return 1\n", "    Hello"] + _texts_with_specials(base)
    # the tiny base lacks some Latin letters ("J"), which become new pieces: texts holding one may change
    changed = [t for t in texts if base(t).input_ids != (ids := extended(t).input_ids)
               and not any(i >= extension.first_new for i in ids)]
    assert changed == [] and sum(base(t).input_ids == extended(t).input_ids for t in texts) > len(texts) * 0.9
    assert extended("<unk>Hello world<unk>", add_special_tokens=False).input_ids[0] == base.unk_token_id
    old_sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_like_base / "tokenizer.model"))
    new_sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "zh" / "tokenizer.model"))
    assert not [t for t in indented if old_sp.encode(t) != (ids := new_sp.encode(t))
                and not any(i >= extension.first_new for i in ids)]
    checks = extend.check_tokenizer(mistral_like_base, tmp_path / "zh", indented + _texts())
    assert checks["changed_without_new"] == 0 and checks["old_ids_moved"] == 0


def test_control_symbols_count_in_the_trainer_size(mistral_like_base, sentencepiece_base, tmp_path):
    """The least number of new tokens a corpus needs (every character a piece) is the same with 300 control
    symbols in the base as without: the trainer's size counts them (Mistral v3 has 768)."""
    least = []
    for base in (sentencepiece_base, mistral_like_base):
        with pytest.raises(ConfigError, match="at least") as refused:
            extend.extend_tokenizer(base, corpora.chinese(limit=2000), tmp_path / "out", 100)
        least.append(int(re.search(r"at least (\d+)", str(refused.value))[1]))
    assert least[0] == least[1]


def test_an_extension_that_changes_old_text_is_not_written(sentencepiece_base, tmp_path, monkeypatch):
    """The writer's own check: old merges ranked otherwise than the base ranks them (here: by id reversed, a
    stand-in for a conversion that ranks them differently) change old text, and nothing is published."""
    real = spm.extend_sentencepiece_json

    def reranked(data, model_bytes, pieces, first):
        extended = real(data, model_bytes, pieces, first)
        old = len(data["model"]["merges"])
        extended["model"]["merges"] = extended["model"]["merges"][:old][::-1] + extended["model"]["merges"][old:]
        return extended

    monkeypatch.setattr(spm, "extend_sentencepiece_json", reranked)
    with pytest.raises(ConfigError, match="changes old text"):
        extend.extend_tokenizer(sentencepiece_base, corpora.chinese(limit=LEARN), tmp_path / "zh", 4000)
    assert not (tmp_path / "zh").exists() and not (tmp_path / "zh.partial").exists()
