"""Extending a tokenizer's vocabulary without changing what it does to old text.

Two kinds of tokenizer, two merge paths (`kind` tells which one a folder needs):

- **Byte-level BPE** (`tokenizer.json` with a ByteLevel pre-tokenizer: GPT-2, Llama 3, Qwen2, SmolLM2).
  New tokens must be *merges*: a token added as a plain vocabulary entry (an "added token") is matched
  in the raw text before byte-level encoding, which breaks spacing and decoding. `learn_bpe_merges`
  continues the base model's BPE training on your corpus: every word (as the base's own pre-tokenizer
  splits it) starts as the base's tokenization of it, and the most frequent adjacent pair is merged,
  repeatedly. The merges are appended after all old merges, so BPE applies every old merge first: old
  text comes out as before, and every new token is a join of old tokens of the same word.
- **SentencePiece** (`tokenizer.model`: Llama 2, Mistral). `merge_sentencepiece` appends the pieces of a
  model trained on your corpus (with the base's own normalizer, byte fallback and dummy prefix) to the
  base's protobuf, with scores below every old score and decreasing in learned order (distinct in float32:
  `scores_below`). (Appending with score 0, as the widely copied merge script does, lets every new piece
  outrank the old merges.) The Hugging Face tokenizer is the base's own with the new pieces' merges
  appended after every old merge (`extend_sentencepiece_json`), not a new conversion of the model:
  transformers 5 ranks converted merges by id, which on Mistral's model tokenizes indented text
  differently from the user's tokenizer, and its config (special tokens matched in text) is kept.

Both keep every old id on its piece and every special token on its id, and report new tokens that no
text of the corpus produces (`unreached`), which `prune` removes.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pai_cookbook.core import inputs
from pai_cookbook.core.model_config import ConfigError

Kind = Literal["byte_bpe", "sentencepiece"]


def kind(folder: str | Path) -> Kind:
    """Which merge path a Hugging Face tokenizer folder needs.

    Raises:
        ConfigError: a tokenizer the cookbook cannot extend (WordPiece, Unigram tokenizer.json, a BPE
            without byte-level pre-tokenization and without a SentencePiece model, no tokenizer at all).
    """
    folder = Path(folder)
    if (folder / "tokenizer.model").exists():
        return "sentencepiece"
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ConfigError(f"{folder} has neither tokenizer.model (SentencePiece) nor tokenizer.json (byte-level "
                          f"BPE): the cookbook extends those two kinds. Save the model's tokenizer there with "
                          f"AutoTokenizer.from_pretrained(...).save_pretrained('{folder}').")
    data = inputs.read_json(path, fix=f"Save the tokenizer there again (AutoTokenizer.from_pretrained(...)"
                                      f".save_pretrained('{folder}')).")
    model_type = data.get("model", {}).get("type")
    if model_type == "BPE" and _has_byte_level(data.get("pre_tokenizer")):
        return "byte_bpe"
    raise ConfigError(f"{path}: a {model_type} model with pre-tokenizer "
                      f"{(data.get('pre_tokenizer') or {}).get('type')}; the cookbook extends byte-level BPE "
                      f"tokenizer.json files (GPT-2, Llama 3, Qwen2) and SentencePiece tokenizer.model files (Llama 2, "
                      f"Mistral). For this tokenizer, train a new one on your corpus instead of extending it.")


def _has_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))


# --------------------------------------------------------------------------------------------------
# Byte-level BPE: continue the base's merges on a corpus
# --------------------------------------------------------------------------------------------------
@dataclass
class Merges:
    """New BPE merges learned as a continuation of a base tokenizer, in the order they apply."""

    pairs: list[tuple[str, str]]
    counts: list[int]
    """How often each merge applied in the corpus when it was learned."""
    requested: int
    words: int
    """Distinct pre-tokenized words of the corpus."""

    @property
    def tokens(self) -> list[str]:
        return [a + b for a, b in self.pairs]


def learn_bpe_merges(backend, texts: Iterable[str], n: int, *, min_frequency: int = 2,
                     ascii_merges: bool = False) -> Merges:
    """Learn up to `n` merges on `texts` as a continuation of `backend` (a `tokenizers.Tokenizer`, BPE).

    Words are split by the base's own normalizer and pre-tokenizer and start as the base model's
    tokenization, so new merges only ever join old tokens within a word. A merge whose result is
    already a token is never learned (it would change how old text tokenizes). Ties between equally
    frequent pairs go to the smaller pair, so the result is the same on every run and machine.

    Args:
        backend: the base tokenizer's `tokenizers.Tokenizer` (`hf_tokenizer.backend_tokenizer`).
        n: merges wanted.
        min_frequency: a pair seen fewer times is not merged (learning stops there).
        ascii_merges: also learn merges whose token is all ASCII. Off by default: a corpus of Chinese
            still holds Latin words ("Ron Finley"), and their merges would retokenize the base's own
            English (measured: English tokens per character -0.6% with them, unchanged without).
    """
    words_count: Counter[str] = Counter()
    for text in texts:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words_count.update(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text))
    vocab = backend.get_vocab(with_added_tokens=True)
    words = [[token.value for token in backend.model.tokenize(word)] for word in words_count]
    freqs = list(words_count.values())

    pair_count: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for i, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_count[pair] += freq
            where[pair].add(i)
    heap = [(-count, pair) for pair, count in pair_count.items()]
    heapq.heapify(heap)
    pairs: list[tuple[str, str]] = []
    counts: list[int] = []
    while heap and len(pairs) < n:
        negative, pair = heapq.heappop(heap)
        count = pair_count.get(pair, 0)
        if -negative != count:  # stale: the count fell since this entry was pushed
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        if count < min_frequency:
            break
        joined = pair[0] + pair[1]
        if joined in vocab or not (ascii_merges or any(_BYTES[c] >= 0x80 for c in joined)):
            continue  # an old token (merging into it would change old text's tokenization), or ASCII
        vocab[joined] = len(vocab)
        pairs.append(pair)
        counts.append(count)
        del pair_count[pair]
        grown: set[tuple[str, str]] = set()
        for i in where.pop(pair, ()):
            in_word: set[tuple[str, str]] = set()
            words[i] = _merge_word(words[i], pair, joined, freqs[i], pair_count, in_word)
            for new in in_word:
                where[new].add(i)
            grown |= in_word
        for new in grown:
            heapq.heappush(heap, (-pair_count[new], new))
    return Merges(pairs, counts, n, len(words))


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table, which `tokenizers`' ByteLevel uses):
    printable bytes stand for themselves, the others are shifted to unused code points."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(shifted)}


_BYTES = _byte_level_alphabet()
"""Byte-level character -> the byte it stands for."""


def _merge_word(word: list[str], pair: tuple[str, str], joined: str, freq: int,
                pair_count: Counter[tuple[str, str]], grown: set[tuple[str, str]]) -> list[str]:
    """`word` with every occurrence of `pair` (left to right, non-overlapping) replaced by `joined`; the
    counts of the neighbouring pairs are moved to the new pairs, which are collected in `grown`."""
    a, b = pair
    out: list[str] = []
    i, last = 0, len(word) - 1
    while True:
        try:
            j = word.index(a, i)  # list.index scans in C: most of a long word is skipped at that speed
        except ValueError:
            out.extend(word[i:])
            break
        if j < last and word[j + 1] == b:
            out.extend(word[i:j])
            if out:
                pair_count[(out[-1], a)] -= freq
                pair_count[(out[-1], joined)] += freq
                grown.add((out[-1], joined))
            if j + 2 <= last:
                pair_count[(b, word[j + 2])] -= freq
                pair_count[(joined, word[j + 2])] += freq
                grown.add((joined, word[j + 2]))
            out.append(joined)
            i = j + 2
        else:
            out.extend(word[i:j + 1])
            i = j + 1
    pair_count.pop(pair, None)
    return out


def extend_bpe_json(data: dict[str, Any], pairs: list[tuple[str, str]]) -> tuple[dict[str, Any], int]:
    """A copy of a BPE tokenizer.json (as a dict, as the base tokenizer serializes itself) with `pairs`
    appended as merges and their tokens as vocabulary entries; returns it and the first new id.

    New ids follow every existing id (model vocabulary and added tokens). Added tokens that are not in
    `model.vocab` (Qwen's specials, Llama 3's in Meta's layout) are written into it at their ids first:
    `tokenizers` (0.23) ignores an added token's recorded id when its text is not in the vocabulary and
    gives it the next id from len(vocab) upwards, so once the vocabulary grows they would move.
    """
    data = json.loads(json.dumps(data))
    model = data["model"]
    vocab = model["vocab"]
    pin_added_tokens(data)
    first = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))], default=-1) + 1
    strings_format = bool(model["merges"]) and isinstance(model["merges"][0], str)  # "a b" (older files)
    for offset, (a, b) in enumerate(pairs):
        if a + b in vocab:
            raise ConfigError(f"merge {a!r} + {b!r} makes {a + b!r}, which is already token "
                              f"{vocab[a + b]}: a merge must make a new token.")
        vocab[a + b] = first + offset
        model["merges"].append(f"{a} {b}" if strings_format else [a, b])
    return data, first


def pin_added_tokens(data: dict[str, Any]) -> None:
    """Write the added tokens of a tokenizer.json dict that `model.vocab` lacks into it, at their ids (in
    place), so that they keep those ids however the vocabulary grows.

    Raises:
        ConfigError: an added token's id is another vocabulary entry's (the file is not what its
            tokenizer serialized).
    """
    vocab = data["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()}
    for token in data.get("added_tokens", []):
        if token["content"] in vocab:
            continue
        if token["id"] in by_id:
            raise ConfigError(f"added token {token['content']!r} has id {token['id']}, which is also vocabulary entry "
                              f"{by_id[token['id']]!r}; expected the tokenizer.json its tokenizer serializes "
                              f"(tokenizer.backend_tokenizer.to_str()). Save the base with save_pretrained first.")
        vocab[token["content"]] = token["id"]
        by_id[token["id"]] = token["content"]


# --------------------------------------------------------------------------------------------------
# Reachability
# --------------------------------------------------------------------------------------------------
@dataclass
class Reach:
    """Which new tokens some text of a corpus produces."""

    produced: Counter[int] = field(default_factory=Counter)
    """New id -> occurrences in the corpus's tokenization."""
    unreached: list[int] = field(default_factory=list)


def reach(hf_tokenizer, texts: Iterable[str], first_new: int) -> Reach:
    """Tokenize `texts` with the extended tokenizer and count the new ids (>= first_new) it produces."""
    produced: Counter[int] = Counter()
    for text in texts:
        produced.update(i for i in hf_tokenizer(text, add_special_tokens=False).input_ids if i >= first_new)
    unreached = [i for i in range(first_new, len(hf_tokenizer)) if i not in produced]
    return Reach(produced, unreached)


def prune(pairs: list[tuple[str, str]], unreached: list[int]) -> tuple[list[tuple[str, str]], list[int]]:
    """Drop the merges of unreached new tokens (indices into `pairs`) that no kept token is built from.

    A token the corpus only ever merges further ("天" when every "天" is followed by "气") is still a step
    towards a token it does produce, so it stays; one that is neither is removed. Returns the kept
    pairs (in order) and the dropped indices.
    """
    index = {a + b: k for k, (a, b) in enumerate(pairs)}
    keep = set(range(len(pairs))) - set(unreached)
    stack = list(keep)
    while stack:  # every kept token's components are kept
        for part in pairs[stack.pop()]:
            k = index.get(part)
            if k is not None and k not in keep:
                keep.add(k)
                stack.append(k)
    return [p for k, p in enumerate(pairs) if k in keep], sorted(set(range(len(pairs))) - keep)


# --------------------------------------------------------------------------------------------------
# SentencePiece: train with the base's settings, append pieces below every old score
# --------------------------------------------------------------------------------------------------
_TRAINER_FIELDS = ("model_type", "byte_fallback", "split_digits", "split_by_unicode_script", "split_by_number",
                   "split_by_whitespace", "treat_whitespace_as_suffix", "allow_whitespace_only_pieces",
                   "max_sentencepiece_length", "unk_id", "bos_id", "eos_id", "pad_id", "unk_piece", "bos_piece",
                   "eos_piece", "pad_piece", "unk_surface")
_NORMALIZER_FIELDS = ("add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces")
LLAMA2_SETTINGS = dict(model_type="bpe", byte_fallback=True, split_digits=True, add_dummy_prefix=True,
                       remove_extra_whitespaces=False, normalization_rule_name="identity",
                       allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
"""Llama 2's SentencePiece training settings (what its tokenizer.model records)."""


def _proto(data: bytes):
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(data)
    return model


def sentencepiece_settings(model_bytes: bytes) -> dict[str, Any]:
    """The training settings a SentencePiece model records (normalizer, byte fallback, dummy prefix,
    special pieces), as `SentencePieceTrainer.train` arguments: a new model trained with them splits
    text the way the base does."""
    model = _proto(model_bytes)
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
    base, extra = _proto(base_bytes), _proto(extra_bytes)
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
    base = _proto(base_bytes)
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
    model = _proto(model_bytes)
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
