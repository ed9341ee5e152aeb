"""Vocabulary extension on real tokenizers: what `extend.extend_tokenizer` keeps and gains on released
vocabularies, against adding the same strings with `tokenizer.add_tokens` (LLaMA-Factory's route).

    rows = real_tokenizers.matrix("runs/extend-matrix")   # one dict per tokenizer (and one per add_tokens baseline)

The vocabularies, fetched once with pip and cached (never vendored):

- llama.cpp's vocabulary GGUF files in the `llama-cpp-python` 0.3.36 sdist (`real_templates.fetch`), read by
  transformers' GGUF support: Llama 3 (byte-level BPE), Qwen2, DeepSeek-LLM, Llama 2 (SentencePiece) and Phi-3
  (Llama 2's pieces and 64 tokens added beyond them), each with llama.cpp's reference strings and the ids
  llama.cpp gives them (`real_templates.vocab_tests`). A SentencePiece vocabulary's tokenizer.model is rebuilt
  from the GGUF's pieces, scores and types (what llama.cpp's converter read from it), with Llama 2's settings.
- Llama 3 in Meta's layout: the same vocabulary with its 256 special tokens outside `model.vocab`.
- Mistral's own SentencePiece models in the `mistral-common` wheel: v1 (32,000 pieces, whitespace runs at low
  ids scored -1e9) and v3 (768 control and user-defined symbols), with the Hugging Face tokenizer that
  transformers makes from them.

Each row measures: old ids moved; reference strings whose ids changed (against the base's Hugging Face tokenizer,
and against llama.cpp's where the base agrees with it); texts the extension fails to round-trip where the base
does not; English paragraphs tokenized differently; Chinese tokens per character before and after (held-back
CTCPC sentences); for SentencePiece also old text that SentencePiece itself tokenizes differently.

    python -m pai_cookbook.real_tokenizers     # build the bases, run the matrix, print the table
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pai_cookbook import corpora, real_templates, smollm2
from pai_cookbook.core.progress import quiet_transformers

MISTRAL_PACKAGE, MISTRAL_VERSION = "mistral-common", "1.13.1"
MISTRAL_MODELS = {"mistral-v1": "tokenizer.model.v1", "mistral-v3": "mistral_instruct_tokenizer_240323.model.v3"}
"""Files of mistral_common/data/ in the wheel (Apache-2.0)."""
NEW_TOKENS = {"byte-level BPE": 2000, "SentencePiece": 5000}
"""New tokens asked for. SentencePiece needs every character of the corpus (99.95% coverage: thousands on LEARN
sentences) to be a piece before any merge, so it is asked for more."""
LEARN = 10000
"""Chinese sentences learned from (~210k characters): seconds per tokenizer."""
HELD_OUT = 1000
ENGLISH = 1000
SOURCE_FILE = "real_tokenizers.json"
"""Written last into each finished base folder: what it was made from."""


@dataclass(frozen=True)
class Case:
    """A released vocabulary as a Hugging Face tokenizer folder the cookbook extends."""

    id: str
    source: str
    """"gguf:<vocab>" (llama.cpp's ggml-vocab-<vocab>.gguf), "gguf-meta:<vocab>" (specials moved out of
    model.vocab, as Meta's tokenizer.json has them) or "mistral:<file>"."""
    family: str
    vocab: str | None = None
    """The llama.cpp vocabulary whose reference strings apply; None: none."""


CASES = [
    Case("llama-3", "gguf:llama-bpe", "byte-level BPE", "llama-bpe"),
    Case("llama-3-meta-layout", "gguf-meta:llama-bpe", "byte-level BPE", "llama-bpe"),
    Case("qwen2", "gguf:qwen2", "byte-level BPE", "qwen2"),
    Case("deepseek-llm", "gguf:deepseek-llm", "byte-level BPE", "deepseek-llm"),
    Case("llama-2", "gguf:llama-spm", "SentencePiece", "llama-spm"),
    Case("phi-3", "gguf:phi-3", "SentencePiece", "phi-3"),
    Case("mistral-v1", "mistral:mistral-v1", "SentencePiece"),
    Case("mistral-v3", "mistral:mistral-v3", "SentencePiece"),
]


def root() -> Path:
    return real_templates.root() / "extension-bases"


def _gguf_fields(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
             "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
    return {name.rsplit(".", 1)[1]: reader.fields[name].contents() for name in names}


def sentencepiece_from_gguf(path: Path) -> bytes:
    """The SentencePiece BPE model a llama.cpp "llama" vocabulary was converted from: its pieces, scores and types
    (GGUF's token types are SentencePiece's), with Llama 2's trainer and normalizer settings. Tokens after the last
    normal or byte piece (Phi-3's chat tokens) are added tokens of the Hugging Face tokenizer, not pieces."""
    from sentencepiece import sentencepiece_model_pb2

    fields = _gguf_fields(path)
    model = sentencepiece_model_pb2.ModelProto()
    kinds = (model.SentencePiece.NORMAL, model.SentencePiece.BYTE)
    count = max(i for i, t in enumerate(fields["token_type"]) if t in kinds) + 1
    for piece, score, kind in zip(fields["tokens"][:count], fields["scores"][:count], fields["token_type"][:count]):
        model.pieces.add(piece=piece, score=score, type=kind)
    spec = model.trainer_spec
    spec.model_type, spec.vocab_size, spec.byte_fallback = spec.BPE, count, True
    pieces = list(fields["tokens"][:count])

    def piece_id(key: str, piece: str) -> int:  # Phi-3's eos (32000) is an added token; its model's is </s>
        return fields[key] if fields[key] < count else pieces.index(piece)

    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = (piece_id("unknown_token_id", "<unk>"),
                                                          piece_id("bos_token_id", "<s>"),
                                                          piece_id("eos_token_id", "</s>"), -1)
    # Phi-3's GGUF types <unk> and <s> as control, </s> as user-defined; its model (Llama 2's) has them as these.
    model.pieces[spec.unk_id].type = model.SentencePiece.UNKNOWN
    model.pieces[spec.bos_id].type = model.pieces[spec.eos_id].type = model.SentencePiece.CONTROL
    spec.split_digits = spec.allow_whitespace_only_pieces = True
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = model.normalizer_spec.escape_whitespaces = True
    model.normalizer_spec.remove_extra_whitespaces = False
    return model.SerializeToString()


def _mistral_model(name: str) -> bytes:
    import tempfile
    import zipfile

    cached = root() / "mistral-common" / MISTRAL_MODELS[name]
    if not cached.exists():
        def fill(partial: Path) -> None:
            with tempfile.TemporaryDirectory(prefix="mistral-common-") as scratch:
                wheel, tail = smollm2.pip_download(f"{MISTRAL_PACKAGE}=={MISTRAL_VERSION}", Path(scratch),
                                                   ["--only-binary=:all:"], "mistral_common-*.whl")
                if wheel is None:
                    raise real_templates.FetchError(
                        f"could not fetch {MISTRAL_PACKAGE}=={MISTRAL_VERSION} with pip:\n{tail}\nOn a machine with "
                        f"access run `pip download --no-deps {MISTRAL_PACKAGE}=={MISTRAL_VERSION}` and copy "
                        f"mistral_common/data/{{{','.join(MISTRAL_MODELS.values())}}} from the wheel to {cached.parent}.")
                with zipfile.ZipFile(wheel) as archive:
                    for file in MISTRAL_MODELS.values():
                        (partial / file).write_bytes(archive.read(f"mistral_common/data/{file}"))
            (partial / SOURCE_FILE).write_text(json.dumps({"package": f"{MISTRAL_PACKAGE}=={MISTRAL_VERSION}",
                                                           "license": "Apache-2.0"}))

        real_templates.write_atomically(cached.parent, fill)
    return cached.read_bytes()


def _build(case: Case, partial: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kind, name = case.source.split(":")
    if kind == "mistral":
        (partial / "tokenizer.model").write_bytes(_mistral_model(name))
        (partial / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
             "add_bos_token": True, "add_eos_token": False}))
        with quiet_transformers():
            AutoTokenizer.from_pretrained(partial).save_pretrained(partial)  # what a user's AutoTokenizer makes
        return
    vocab = real_templates.fetch() / "vocab"
    with quiet_transformers():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(vocab, gguf_file=f"ggml-vocab-{name}.gguf")
    tokenizer.save_pretrained(partial)
    if case.family == "SentencePiece":
        (partial / "tokenizer.model").write_bytes(sentencepiece_from_gguf(vocab / f"ggml-vocab-{name}.gguf"))
    if kind == "gguf-meta":  # Meta's tokenizer.json: the specials are added tokens only
        data = json.loads((partial / "tokenizer.json").read_text(encoding="utf-8"))
        for token in data["added_tokens"]:
            data["model"]["vocab"].pop(token["content"], None)
        (partial / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def base_folder(case: Case) -> Path:
    """A Hugging Face tokenizer folder of `case`'s vocabulary, made once and cached.

    Raises:
        real_templates.FetchError: a package could not be fetched with pip.
    """
    folder = root() / case.id
    if (folder / SOURCE_FILE).exists():
        return folder

    def fill(partial: Path) -> None:
        start = time.perf_counter()
        _build(case, partial)
        (partial / SOURCE_FILE).write_text(json.dumps({"source": case.source, "family": case.family,
                                                       "seconds": round(time.perf_counter() - start, 1)}))

    return real_templates.write_atomically(folder, fill)


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False).input_ids if texts else []


def _per_char(ids: list[list[int]], texts: list[str]) -> float:
    return round(sum(map(len, ids)) / sum(map(len, texts)), 4)


def _changed(before: list[list[int]], after: list[list[int]], first: int | None = None) -> int:
    """Texts tokenized differently (without a new token when `first` is given)."""
    return sum(1 for a, b in zip(before, after) if a != b and (first is None or not any(i >= first for i in b)))


def _roundtrip_failures(tokenizer, ids: list[list[int]], texts: list[str]) -> set[int]:
    return {k for k, (row, text) in enumerate(zip(ids, texts)) if tokenizer.decode(row) != text}


def measure(case: Case, out: Path) -> list[dict[str, Any]]:
    """Extend `case`'s base with NEW_TOKENS[family] tokens learned from LEARN Chinese sentences into `out`; the row of the
    extension and the row of the add_tokens baseline (the same strings added with `tokenizer.add_tokens`)."""
    from pai_cookbook import extend
    from pai_cookbook.core import tokenizer as tokenizers

    base_dir = base_folder(case)
    references = real_templates.vocab_tests(case.vocab) if case.vocab else []
    held_out, english = corpora.chinese("held_out", limit=HELD_OUT), corpora.english(limit=ENGLISH)
    edge = corpora.EDGE_CASES + [text for text, _ in references]
    start = time.perf_counter()
    with quiet_transformers():
        extension = extend.extend_tokenizer(base_dir, corpora.chinese(limit=LEARN), out,
                                               NEW_TOKENS[case.family], overwrite=True)
        seconds = round(time.perf_counter() - start, 1)
        base, extended = tokenizers.load(base_dir), tokenizers.load(out)
    first = extension.first_new
    old_vocab, new_vocab = base.get_vocab(), extended.get_vocab()
    ref_texts = [text for text, _ in references]
    ref_base, ref_new = _ids(base, ref_texts), _ids(extended, ref_texts)
    agree = [k for k, (_, ids) in enumerate(references) if ref_base[k] == ids]
    zh_base, zh_new = _ids(base, held_out), _ids(extended, held_out)
    en_base, en_new = _ids(base, english), _ids(extended, english)
    every = edge + held_out[:200] + english[:200]
    rt_base = _roundtrip_failures(base, _ids(base, every), every)
    rt_new = _roundtrip_failures(extended, _ids(extended, every), every)
    row = {"tokenizer": case.id, "family": case.family, "method": "merge", "base_size": len(base),
           "added": extension.added, "seconds": seconds,
           "old_ids_moved": sum(1 for piece, i in old_vocab.items() if new_vocab.get(piece) != i),
           "specials_moved": len(extend.moved_specials(base, extended)),
           "reference_strings": len(references), "base_agrees_llama_cpp": len(agree),
           "reference_changed": _changed(ref_base, ref_new, first),
           "llama_cpp_changed": sum(1 for k in agree if ref_new[k] != references[k][1]
                                    and not any(i >= first for i in ref_new[k])),
           "roundtrip_new_failures": len(rt_new - rt_base), "english_changed": _changed(en_base, en_new),
           "zh_tokens_per_char_before": _per_char(zh_base, held_out), "zh_tokens_per_char_after": _per_char(zh_new, held_out)}
    if (out / "tokenizer.model").exists():
        import sentencepiece

        old_sp = sentencepiece.SentencePieceProcessor(model_file=str(base_dir / "tokenizer.model"))
        new_sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        old_text = edge + english + ["    " + t for t in english[:200]]
        row["sentencepiece_changed"] = _changed(old_sp.encode(old_text), new_sp.encode(old_text), first)
        row["sentencepiece_hf_disagree_base"] = _changed(old_sp.encode(held_out + old_text), _ids(base, held_out + old_text))
        row["sentencepiece_hf_disagree"] = _changed(new_sp.encode(held_out + old_text), _ids(extended, held_out + old_text))
    return [row, _add_tokens_row(case, base_dir, out, held_out, english, every, zh_base, en_base, rt_base)]


def add_tokens_baseline(base_dir: str | Path, extended_dir: str | Path, out: str | Path | None = None):
    """The base tokenizer with the extension's new strings added by `tokenizer.add_tokens` (LLaMA-Factory's route:
    each is matched in the raw text before the tokenizer's own model runs), saved to `out` when given.

    Returns:
        (the tokenizer, how many strings were added).
    """
    from pai_cookbook import extend
    from pai_cookbook.core import tokenizer as tokenizers

    with quiet_transformers():
        added, extended = tokenizers.load(base_dir), tokenizers.load(extended_dir)
    first = extend.read_extension(extended_dir).first_new
    # a byte-level token that holds part of a character decodes to U+FFFD, which no text can match: not added
    strings = {text for text in (extended.decode([i]).strip() for i in range(first, len(extended)))
               if text and "\ufffd" not in text}
    count = added.add_tokens(sorted(strings - set(added.get_vocab())))
    if out is not None:
        added.save_pretrained(out)
    return added, count


def _add_tokens_row(case: Case, base_dir: Path, extended_dir: Path, held_out: list[str], english: list[str],
                    every: list[str], zh_base, en_base, rt_base: set[int]) -> dict[str, Any]:
    """The same new strings added with `tokenizer.add_tokens` (matched in the text before the model runs)."""
    from pai_cookbook.core import tokenizer as tokenizers

    added, count = add_tokens_baseline(base_dir, extended_dir)
    zh, en = _ids(added, held_out), _ids(added, english)
    return {"tokenizer": case.id, "family": case.family, "method": "add_tokens", "base_size": len(tokenizers.load(base_dir)),
            "added": count, "english_changed": _changed(en_base, en),
            "roundtrip_new_failures": len(_roundtrip_failures(added, _ids(added, every), every) - rt_base),
            "zh_tokens_per_char_before": _per_char(zh_base, held_out), "zh_tokens_per_char_after": _per_char(zh, held_out)}


def matrix(out_dir: str | Path, cases: list[Case | str] | str | None = None) -> list[dict[str, Any]]:
    """`measure` of every case (default or "all": CASES; or cases and their ids); the extended tokenizers are written
    under `out_dir`.

    Returns:
        Rows (dicts) in case order, each extension followed by its add_tokens baseline.
    """
    from pai_cookbook.core.model_config import ConfigError

    by_id = {case.id: case for case in CASES}
    chosen = CASES if cases in (None, "all") else [by_id.get(c, c) if isinstance(c, str) else c for c in cases]
    unknown = [c for c in chosen if isinstance(c, str)]
    if unknown:
        raise ConfigError(f"real tokenizer(s) {unknown} are not in the matrix; choose from {list(by_id)} or 'all'.")
    rows = []
    for case in chosen:
        rows += measure(case, Path(out_dir) / case.id)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (missing values blank)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    import tempfile

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="extend-matrix-") as out:
        rows = matrix(out)
    print(table(rows))
    print(f"all: {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
