"""What a vocabulary extension must keep, checked: every old id and special token on its id, old text tokenized as
the base tokenizes it (the writer's own check before it publishes, `check_old_text`), no new token spelling a
special one."""

from __future__ import annotations

from pathlib import Path

from pai_cookbook.core.configs.config import ConfigError


def moved_specials(base, extended) -> dict[str, tuple[int, int]]:
    """Special tokens of `base` whose id differs in `extended`: text -> (old id, new id)."""
    return {t.content: (i, extended.convert_tokens_to_ids(t.content)) for i, t in base.added_tokens_decoder.items()
            if extended.convert_tokens_to_ids(t.content) != i}


def check_specials(base, extended) -> None:
    """Special tokens keep their ids in the extended tokenizer."""
    moved = moved_specials(base, extended)
    if moved:
        raise ConfigError(f"special tokens would change ids: {moved}; the base tokenizer's added tokens must keep "
                          f"theirs (report this: the merge should never move them).")


CHECKED_CORPUS_TEXTS = 2000
"""Texts of the learning corpus the writer's own check tokenizes (with the edge cases and English)."""
INDENTS = ("    ", "        ", "\t", "  ")
"""Indentation put before English in the writer's check: whitespace runs are where SentencePiece conversions
differ (Mistral's ▁▁ pieces)."""


def old_texts(base, texts: list[str] = ()) -> list[str]:
    """What an extension must tokenize exactly as the base: the edge cases, English paragraphs (as they are,
    indented and as lines of code), each special token typed in text, and the first `CHECKED_CORPUS_TEXTS` of
    `texts`."""
    from pai_cookbook import corpora

    english = corpora.english(limit=300)
    indented = [indent + text for indent in INDENTS for text in english[:50]]
    code = ["\n".join(indent + t for indent, t in zip(("", *INDENTS), english[k:k + 5])) for k in range(0, 100, 5)]
    specials = sorted({t.content for t in base.added_tokens_decoder.values()})
    typed = [f"{s}Hello world{s}" for s in specials] + [f"Hello {s} world" for s in specials]
    return corpora.EDGE_CASES + english + indented + code + typed + list(texts[:CHECKED_CORPUS_TEXTS])


def check_old_text(base, extended, base_dir: Path, folder: Path, first: int, texts: list[str]) -> dict[str, int]:
    """Refuse to publish an extension that changes any old id, or the tokens of any text it tokenizes without
    a new token (against the base's Hugging Face tokenizer, and for SentencePiece against SentencePiece too).
    Returns the texts checked per tokenizer.

    Raises:
        ConfigError: naming the first text that changed, with both tokenizations.
    """
    old_vocab, new_vocab = base.get_vocab(), extended.get_vocab()
    moved = [(piece, i, new_vocab.get(piece)) for piece, i in old_vocab.items() if new_vocab.get(piece) != i]
    if moved:
        raise ConfigError(f"the extended tokenizer moves {len(moved)} old token(s), first {moved[0][0]!r} from id "
                          f"{moved[0][1]} to {moved[0][2]}; expected every old id kept. Nothing was written; "
                          f"report this with the base tokenizer (the merge should never move an old id).")
    checks = old_texts(base, texts)
    encoders = [("Hugging Face", lambda t: base(t, add_special_tokens=False).input_ids,
                 lambda t: extended(t, add_special_tokens=False).input_ids)]
    if (folder / "tokenizer.model").exists() and (base_dir / "tokenizer.model").exists():
        import sentencepiece

        old_sp = sentencepiece.SentencePieceProcessor(model_file=str(base_dir / "tokenizer.model"))
        new_sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        encoders.append(("SentencePiece", old_sp.encode, new_sp.encode))
    for name, old_encode, new_encode in encoders:
        for text in checks:
            before, after = old_encode(text), new_encode(text)
            if before != after and not any(i >= first for i in after):
                raise ConfigError(f"the extended tokenizer ({name}) changes old text {text[:80]!r}: {before[:12]} "
                                  f"became {after[:12]} with no new token; expected old text unchanged. Nothing was "
                                  f"written; report this with the base tokenizer.")
    return {name: len(checks) for name, _, _ in encoders}


def check_no_special_spelled(base, texts: list[str]) -> None:
    """No new token may spell a special token: text holding it could not be told from the special token."""
    specials = {t.content for t in base.added_tokens_decoder.values()}
    clash = sorted(specials.intersection(texts))
    if clash:
        raise ConfigError(f"new token(s) {clash} spell special tokens of the base tokenizer; the corpus contains "
                          f"that markup as text. Remove it from the corpus (or strip special tokens first).")
