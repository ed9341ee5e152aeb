"""SentencePiece models (`tokenizer.model`: Llama 2, Mistral, Phi-3) extended without changing old text: a model trained
on the corpus with the base's own settings, its new pieces appended below every old score (distinct in float32:
`scores_below`), and the base's own Hugging Face tokenizer with their merges appended after every old merge
(`extend_sentencepiece_json`), not a new conversion (transformers 5 ranks converted merges by id, which on Mistral's
model tokenizes indented text differently from the user's tokenizer). Byte-level BPE is `core.text.vocabulary`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.text.vocabulary import pin_added_tokens

_TRAINER_FIELDS = ("model_type", "byte_fallback", "split_digits", "split_by_unicode_script", "split_by_number",
                   "split_by_whitespace", "treat_whitespace_as_suffix", "allow_whitespace_only_pieces",
                   "max_sentencepiece_length", "unk_id", "bos_id", "eos_id", "pad_id", "unk_piece", "bos_piece",
                   "eos_piece", "pad_piece", "unk_surface")
_NORMALIZER_FIELDS = ("add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces")
LLAMA2_SETTINGS = dict(model_type="bpe", byte_fallback=True, split_digits=True, add_dummy_prefix=True,
                       remove_extra_whitespaces=False, normalization_rule_name="identity",
                       allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
"""Llama 2's SentencePiece training settings (what its tokenizer.model records)."""


def model_proto(data: bytes):
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(data)
    return model


def sentencepiece_settings(model_bytes: bytes) -> dict[str, Any]:
    """The training settings a SentencePiece model records (normalizer, byte fallback, dummy prefix,
    special pieces), as `SentencePieceTrainer.train` arguments: a new model trained with them splits
    text the way the base does."""
    model = model_proto(model_bytes)
    spec = model.trainer_spec
    settings: dict[str, Any] = {}
    for name in _TRAINER_FIELDS:
        descriptor = spec.DESCRIPTOR.fields_by_name[name]
        value = getattr(spec, name)
        settings[name] = descriptor.enum_type.values_by_number[value].name.lower() if descriptor.enum_type else value
    for name in _NORMALIZER_FIELDS:
        settings[name] = getattr(model.normalizer_spec, name)
    settings["normalization_rule_name"] = model.normalizer_spec.name
    named = {spec.unk_piece, spec.bos_piece, spec.eos_piece, spec.pad_piece}  # the trainer defines these itself
    user = [p.piece for p in model.pieces if p.type == p.USER_DEFINED and p.piece not in named]
    control = [p.piece for p in model.pieces if p.type == p.CONTROL and p.piece not in named]
    return settings | ({"user_defined_symbols": user} if user else {}) | ({"control_symbols": control} if control else {})


def train_sentencepiece(texts: Iterable[str], vocab_size: int, settings: dict[str, Any]) -> bytes:
    """A SentencePiece model of `vocab_size` pieces trained on `texts` with `settings`; its bytes."""
    import io

    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(list(texts)), model_writer=out,
                                             vocab_size=vocab_size, character_coverage=0.9995, num_threads=1,
                                             minloglevel=2, **settings)
    return out.getvalue()


def new_pieces(base_bytes: bytes, extra_bytes: bytes) -> list[str]:
    """The pieces of `extra` to append to `base`, in `extra`'s learned order.

    Only pieces with at least one character the base has no piece for are taken ("天气", not a new
    Latin piece such as "hell"): BPE keeps merging after the base's merges run out, so a new piece made
    of base characters would change how old text tokenizes (measured: 15 of 181 English lines).
    """
    base, extra = model_proto(base_bytes), model_proto(extra_bytes)
    normal = base.SentencePiece.NORMAL
    if base.trainer_spec.model_type != base.trainer_spec.BPE:
        raise ConfigError("the base tokenizer.model is a SentencePiece unigram model; the cookbook extends BPE "
                          "models (Llama 2, Mistral). Train a new tokenizer for this one.")
    have = {p.piece for p in base.pieces}
    base_chars = {p.piece for p in base.pieces if len(p.piece) == 1 and p.type == normal}
    return [p.piece for p in extra.pieces
            if p.type == normal and p.piece not in have and not all(c in base_chars for c in p.piece)]


def scores_below(lowest: float, n: int) -> list[float]:
    """`n` scores, each below `lowest` and the one before it *as float32* (the protobuf stores float32).

    Steps of 1.0 collapse far from zero: below Mistral's -1e9 a float32 step is 64, so min-1, min-2, ...
    gave 3,380 new pieces 54 distinct scores, and pieces that tie are ranked by position, not by the
    order they were learned in. Each step here is at least one float32 spacing."""
    import numpy as np

    out, score = [], np.float32(lowest)
    for _ in range(n):
        lower = np.float32(score - np.float32(1.0))
        score = lower if lower < score else np.nextafter(score, np.float32(-np.inf))
        out.append(float(score))
    return out


def append_pieces(base_bytes: bytes, pieces: list[str], *, zero_scores: bool = False,
                  reserved: dict[int, str] | None = None) -> bytes:
    """`base` with `pieces` appended as normal pieces, scored below every old score and decreasing.

    reserved: ids at or beyond the base's pieces that the Hugging Face tokenizer already gives to added
        tokens ([PAD] at 32000 in many Llama 2 fine-tunes, Phi-3's 64 chat tokens). They are written as
        control pieces first, so the new pieces' ids follow them in both tokenizers (a control piece is
        never matched in text, so SentencePiece's tokenization of old text is unchanged); an id between
        them that nothing holds becomes an unused piece.
    zero_scores=True is the widely copied merge (score 0 for every new piece), kept for showing what
    it breaks: SentencePiece then prefers new pieces over old merges, and transformers (which ranks a
    merge by the new piece's id) no longer agrees with it.
    """
    base = model_proto(base_bytes)
    reserved = reserved or {}
    for i in range(len(base.pieces), max(reserved, default=-1) + 1):
        held = base.pieces.add()
        held.piece = reserved.get(i, f"<pai_cookbook_unused_{i}>")
        held.type = base.SentencePiece.CONTROL if i in reserved else base.SentencePiece.UNUSED
        held.score = 0.0
    scores = scores_below(min(p.score for p in base.pieces), len(pieces))
    for text, score in zip(pieces, scores):
        new = base.pieces.add()
        new.piece, new.type, new.score = text, base.SentencePiece.NORMAL, 0.0 if zero_scores else score
    base.trainer_spec.vocab_size = len(base.pieces)
    return base.SerializeToString()


def score_ranked_merges(model_bytes: bytes, pieces: list[str] | None = None,
                        operands: set[str] | None = None) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece model's pieces, ranked as SentencePiece applies them: by the score
    of the piece they make, highest first (ties by id), every split into two pieces of the model.

    transformers 5 ranks converted merges by the made piece's id instead; on Mistral's model, whose
    whitespace runs (▁▁ at id 259, ▁▁▁▁ at 260, ...) have low ids and score -1e9, that merges spaces
    before words and tokenizes indented text differently from SentencePiece.

    Args:
        pieces: only the merges that make these pieces (in this order when given): new pieces appended
            to a base whose own merges stay as they are.
        operands: pieces a merge may join (default: the model's normal and user-defined pieces).
    """
    model = model_proto(model_bytes)
    kinds = (model.SentencePiece.NORMAL, model.SentencePiece.USER_DEFINED)
    ids = {p.piece: i for i, p in enumerate(model.pieces)}
    if operands is None:
        operands = {p.piece for p in model.pieces if p.type in kinds}
    if pieces is None:
        made = sorted((i for i, p in enumerate(model.pieces) if p.type == model.SentencePiece.NORMAL),
                      key=lambda i: (-model.pieces[i].score, i))
        pieces = [model.pieces[i].piece for i in made]
    merges = []
    for piece in pieces:
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in operands and piece[k:] in operands]
        merges.extend(sorted(splits, key=lambda pair: (ids[pair[0]], ids[pair[1]])))
    return merges


def extend_sentencepiece_json(data: dict[str, Any], model_bytes: bytes, pieces: list[str],
                              first: int) -> dict[str, Any]:
    """A copy of the base's Hugging Face tokenizer.json (a BPE model converted from SentencePiece, as a
    dict) with `pieces` at ids `first`, `first + 1`, ... and their merges appended after every old one.

    The old merges stay exactly as the base ranks them, so old text tokenizes as the base tokenizes it
    (whether or not the base agrees with SentencePiece); a new merge ranks below every old merge, as the
    new pieces' scores do in SentencePiece. `model_bytes` is the extended SentencePiece model.
    """
    data = json.loads(json.dumps(data))
    model = data["model"]
    if model.get("type") != "BPE":
        raise ConfigError(f"the base's tokenizer.json holds a {model.get('type')} model; expected the BPE model "
                          f"transformers converts a SentencePiece BPE tokenizer.model into. Save the base with "
                          f"AutoTokenizer.from_pretrained(...).save_pretrained(...) and extend that folder.")
    pin_added_tokens(data)
    vocab = model["vocab"]
    special = {t["content"] for t in data.get("added_tokens", [])}
    operands = {p for p in vocab if p not in special} | set(pieces)
    taken = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))], default=-1)
    if taken >= first:
        raise ConfigError(f"the new pieces would start at id {first}, but the base tokenizer already has id {taken}; "
                          f"expected the first new id after every old one (report this with the base tokenizer).")
    for offset, piece in enumerate(pieces):
        if piece in vocab:
            raise ConfigError(f"new piece {piece!r} is already token {vocab[piece]} of the base tokenizer.")
        vocab[piece] = first + offset
    strings_format = bool(model["merges"]) and isinstance(model["merges"][0], str)
    for a, b in score_ranked_merges(model_bytes, pieces, operands):
        model["merges"].append(f"{a} {b}" if strings_format else [a, b])
    return data


def prune_pieces(pieces: list[str], unreached: set[str]) -> list[str]:
    """Drop unreached pieces that no kept piece starts or ends with (SentencePiece's BPE builds a piece
    from two pieces, so such a piece is a step towards nothing)."""
    kept = [p for p in pieces if p not in unreached]
    needed = {q for q in unreached for p in kept if p != q and (p.startswith(q) or p.endswith(q))}
    return [p for p in pieces if p not in unreached or p in needed]


def sentencepiece_to_hf(model_bytes: bytes, folder: Path, special: dict[str, str]) -> None:
    """Write a Hugging Face fast tokenizer for a SentencePiece BPE model into `folder` (with the model).

    transformers' own conversion makes the vocabulary; the merges are ranked as SentencePiece ranks them
    (`score_ranked_merges`: by score, where transformers ranks by id). Its Llama class then rebuilds the normalizer as
    Metaspace(prepend_scheme="first"), which drops the dummy prefix before text that starts with a space
    (" hi" gives "▁hi" where SentencePiece gives "▁▁" "hi"); Llama 2's own normalizer (prepend "▁",
    spaces to "▁") is put back and the folder saved as a plain fast tokenizer, so it loads as written.
    """
    import tempfile

    from tokenizers import Tokenizer, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tokenizer.model").write_bytes(model_bytes)
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": True} | special))
        backend = AutoTokenizer.from_pretrained(tmp).backend_tokenizer
    data = json.loads(backend.to_str())
    data["model"]["merges"] = [list(pair) for pair in score_ranked_merges(model_bytes)]
    backend = Tokenizer.from_str(json.dumps(data))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=True, add_eos_token=False,
                                   clean_up_tokenization_spaces=False, split_special_tokens=True, **special)
    fast.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # what transformers 4 and 5 both load verbatim
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (folder / "tokenizer.model").write_bytes(model_bytes)  # for SentencePiece users (Megatron's own tokenizer)
