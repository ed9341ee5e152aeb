"""Extending a tokenizer's vocabulary without changing what it does to old text.

Two kinds of tokenizer, two merge paths (`kind` tells which one a folder needs):

- **Byte-level BPE** (`tokenizer.json` with a ByteLevel pre-tokenizer: GPT-2, Llama 3, Qwen2, SmolLM2).
  New tokens must be *merges*: a token added as a plain vocabulary entry (an "added token") is matched
  in the raw text before byte-level encoding, which breaks spacing and decoding. `learn_bpe_merges`
  continues the base model's BPE training on your corpus: every word (as the base's own pre-tokenizer
  splits it) starts as the base's tokenization of it, and the most frequent adjacent pair is merged,
  repeatedly. The merges are appended after all old merges, so BPE applies every old merge first: old
  text comes out as before, and every new token is a join of old tokens of the same word.
- **SentencePiece** (`tokenizer.model`: Llama 2, Mistral; `core.text.spm`). `extend` appends the pieces of a
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

from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.launching import inputs

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
