"""Vocabulary extension: new tokens learned from your corpus, merged into the base tokenizer, and a
checkpoint grown to match.

    ext = extend.extend_tokenizer(base_dir, texts, "tok/zh", new_tokens=2000)   # learn + merge + check
    extend.grow("ckpt/base", "tok/zh", "ckpt/zh", init="mean")                  # embedding + output rows
    extend.score(["ckpt/base", "ckpt/zh"], {"zh": held_out})                     # bits per character

CLI: `python -m pai_cookbook.extend tokenizer BASE CORPUS OUT --new-tokens N` and
`python -m pai_cookbook.extend grow CKPT TOKENIZER OUT --init mean` (exit code 2 on bad input).

How the tokenizers are merged is `core.text.vocabulary`'s subject. A new token's embedding row starts as
the mean of the rows of the old tokens its text was split into ("天气" = mean("天", "气")); its output
row likewise (untied models). Then, on text without new tokens, the extended model's logits over the
old vocabulary equal the old model's, and the new tokens take little probability: each new logit is a
mean of old logits, far below the top ones in English contexts. `INITS` holds the alternatives for
comparison. The vocabulary is padded to Megatron-Core's multiple of 128 x TP, and the padding rows
are kept out of the softmax by the model (`core.modeling.model.mask_vocab_padding`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import ConfigError
from pai_cookbook.core.launching import cli, inputs, nodes
from pai_cookbook.core.launching.jobs import INITS, GrowJob, ScoreJob
from pai_cookbook.core.text import spm, tokenizer, vocabulary
from pai_cookbook.extension_checks import check_no_special_spelled, check_old_text, check_specials, moved_specials

EXTENSION_FILE = "pai_cookbook_extension.json"
"""Written into an extended tokenizer folder: the base it extends, the first new id, each new token's
old sub-token ids."""


@dataclass
class Extension:
    """What `extend_tokenizer` made (also the contents of EXTENSION_FILE)."""

    kind: str
    base: str
    base_fingerprint: str
    base_size: int
    first_new: int
    size: int
    requested: int
    learned: int
    dropped: list[str] = field(default_factory=list)
    """New tokens no text of the corpus produced (removed)."""
    intermediate: int = 0
    """Kept new tokens that the corpus only ever merges further (BPE needs them to build longer ones)."""
    sources: list[list[int]] = field(default_factory=list)
    """Old ids of each new token's text, in new-id order: what the mean initialisation averages."""
    old_text_checked: dict[str, int] = field(default_factory=dict)
    """Texts the writer tokenized with the base and the extension before publishing it, per tokenizer ("Hugging
    Face", and "SentencePiece" for a tokenizer.model); every one without a new token came out unchanged."""

    @property
    def added(self) -> int:
        return self.size - self.base_size

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "sources"} | {"added": self.added,
                                                                            "dropped": len(self.dropped)}


def read_extension(folder: str | Path) -> Extension:
    path = Path(folder) / EXTENSION_FILE
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no {EXTENSION_FILE}: not a tokenizer made by "
                                f"extend.extend_tokenizer; make one with it first.")
    return Extension(**inputs.read_json(path, fix="Extend the tokenizer again with extend.extend_tokenizer(...)."))


def extend_tokenizer(base_dir: str | Path, texts: list[str], out: str | Path, new_tokens: int, *,
                     min_frequency: int = 2, overwrite: bool = False) -> Extension:
    """Learn up to `new_tokens` tokens from `texts`, merge them into the tokenizer in `base_dir`, check
    the result and write it as a Hugging Face tokenizer folder `out` (atomically).

    Raises:
        ConfigError: a tokenizer kind the cookbook cannot extend; a corpus that yields fewer than
            half the tokens asked for; a new token that spells a special token.
        FileExistsError: `out` holds files and overwrite is False.
    """
    base_dir, out = Path(base_dir), Path(out)
    texts = inputs.listed(texts, "texts", "strings (a single string would be learned one character at a time; pass "
                                          "the lines or documents of your corpus)")
    if not all(isinstance(t, str) for t in texts):
        raise ConfigError("texts must be a list of strings; got a sequence holding other things. Pass the lines or "
                          "documents of your corpus.")
    inputs.integer(new_tokens, "new_tokens")
    if not base_dir.is_dir():
        raise ConfigError(f"base tokenizer folder {base_dir} does not exist; give the folder holding the model's "
                          f"tokenizer files (tokenizer.json or tokenizer.model).")
    kind = vocabulary.kind(base_dir)
    checkpoint.check_writable(out, overwrite)
    base = tokenizer.load(base_dir)
    with checkpoint.writing(out, overwrite) as partial, checkpoint.full_disk_said(
            partial, then=f"nothing of {Path(out).name} was kept; run it again where there is room", catch=OSError):
        if kind == "byte_bpe":
            first, learned, dropped, intermediate = _extend_byte_bpe(base, base_dir, partial, texts, new_tokens,
                                                                     min_frequency)
        else:
            first, learned, dropped, intermediate = _extend_sentencepiece(base, base_dir, partial, texts, new_tokens)
        extended = tokenizer.load(partial)
        check_specials(base, extended)
        checked = check_old_text(base, extended, base_dir, partial, first, texts)
        extension = Extension(kind=kind, base=str(base_dir.resolve()), base_fingerprint=tokenizer.fingerprint(base_dir),
                              base_size=len(base), first_new=first, size=len(extended), requested=new_tokens,
                              learned=learned, dropped=dropped,
                              intermediate=intermediate,
                              sources=sub_tokens(base, extended, first), old_text_checked=checked)
        (partial / EXTENSION_FILE).write_text(json.dumps(asdict(extension), ensure_ascii=False))
    return extension


def _extend_byte_bpe(base, base_dir: Path, folder: Path, texts: list[str], new_tokens: int,
                     min_frequency: int) -> tuple[int, int, list[str], int]:
    merges = vocabulary.learn_bpe_merges(base.backend_tokenizer, texts, new_tokens, min_frequency=min_frequency)
    _check_learned(len(merges.pairs), new_tokens, texts, min_frequency, byte_level=True)
    check_no_special_spelled(base, [base.backend_tokenizer.decoder.decode([t]) for t in merges.tokens])
    first = _write_byte_bpe(base, base_dir, folder, merges.pairs)
    reach = vocabulary.reach(tokenizer.load(folder), texts, first)
    pairs, dropped = vocabulary.prune(merges.pairs, [i - first for i in reach.unreached])
    if dropped:
        _write_byte_bpe(base, base_dir, folder, pairs)
    # A dropped token was never formed on the corpus (had it been, a produced token would be built from it),
    # so dropping it changes no tokenization there: the unreached tokens left are the intermediate ones.
    return first, len(merges.pairs), [merges.tokens[i] for i in dropped], len(reach.unreached) - len(dropped)


def _extend_sentencepiece(base, base_dir: Path, folder: Path, texts: list[str],
                          new_tokens: int) -> tuple[int, int, list[str], int]:
    base_bytes = (base_dir / "tokenizer.model").read_bytes()
    settings = spm.sentencepiece_settings(base_bytes)
    # Room for the pieces the base already has (bytes, specials, shared ones): a quarter more. The trainer
    # counts the base's control and user-defined symbols (Mistral v3: 768) inside its vocabulary size.
    symbols = len(settings.get("user_defined_symbols", ())) + len(settings.get("control_symbols", ()))
    size = new_tokens + new_tokens // 4 + 3 + (256 if settings["byte_fallback"] else 0) + symbols
    try:
        extra = spm.train_sentencepiece(texts, size, settings)
    except RuntimeError as err:
        needed = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if needed:  # every character of the corpus (99.95% coverage) must be a piece before any merge
            raise ConfigError(f"the corpus uses {needed[2]} distinct characters (99.95% coverage), and each must be a "
                              f"piece: ask for at least {int(needed[2]) - int(needed[1]) + new_tokens} new tokens, or "
                              f"learn from fewer characters.") from None
        # "Vocabulary size too high (N). Please set it to a value <= M.": too little text
        raise ConfigError(f"the corpus ({len(texts)} texts, {sum(map(len, texts))} characters) cannot give "
                          f"{new_tokens} new pieces ({err}). Give more text or ask for fewer new tokens.") from None
    taken = base.get_vocab()
    pieces = [p for p in spm.new_pieces(base_bytes, extra) if p not in taken][:new_tokens]
    _check_learned(len(pieces), new_tokens, texts, 1)
    check_no_special_spelled(base, [p.replace("\u2581", " ").strip() for p in pieces])
    # Ids the Hugging Face tokenizer gives beyond the SentencePiece pieces ([PAD] at 32000, Phi-3's 64 chat and
    # padding tokens): the new pieces follow them.
    count = len(spm.model_proto(base_bytes).pieces)
    reserved = {i: piece for piece, i in base.get_vocab().items() if i >= count}
    first = max(count, max(reserved, default=-1) + 1)
    base_json = json.loads(base.backend_tokenizer.to_str())
    tokenizer.copy(base_dir, folder, tuple(n for n in tokenizer.FILES if n not in tokenizer.VOCABULARY_FILES))

    def write(chosen: list[str]) -> None:
        model_bytes = spm.append_pieces(base_bytes, chosen, reserved=reserved)
        (folder / "tokenizer.model").write_bytes(model_bytes)
        extended = spm.extend_sentencepiece_json(base_json, model_bytes, chosen, first)
        (folder / "tokenizer.json").write_text(json.dumps(extended, ensure_ascii=False), encoding="utf-8")

    write(pieces)
    extended = tokenizer.load(folder)
    unreached = set(extended.convert_ids_to_tokens(vocabulary.reach(extended, texts, first).unreached))
    kept = spm.prune_pieces(pieces, unreached)
    if len(kept) < len(pieces):
        write(kept)
        unreached = vocabulary.reach(tokenizer.load(folder), texts, first).unreached  # pieces were removed
    return first, len(pieces), [p for p in pieces if p not in kept], len(unreached)


def _check_learned(learned: int, requested: int, texts: list[str], min_frequency: int, byte_level: bool = False) -> None:
    if learned * 2 < requested:
        characters = sum(map(len, texts))
        ascii_share = sum(c.isascii() for t in texts for c in t) / max(characters, 1)
        why = (f" The corpus is {ascii_share:.0%} ASCII, and a byte-level tokenizer is extended only with merges "
               f"whose token holds a non-ASCII byte: an ASCII merge would change how old text (English, code) is "
               f"tokenized, which the base already covers. Extension is for text the base splits into bytes (Chinese, "
               f"say); give such text." if byte_level and ascii_share > 0.9 else "")
        raise ConfigError(f"the corpus ({len(texts)} texts, {characters} characters) gives only {learned} "
                          f"new tokens that occur >= {min_frequency} times, fewer than half of the {requested} asked "
                          f"for.{why} Give more text (a few MB for thousands of tokens) or ask for at most {learned} new "
                          f"tokens.")


def _write_byte_bpe(base, base_dir: Path, folder: Path, pairs: list[tuple[str, str]]) -> int:
    # The base as the user's tokenizer has it (its backend serialized): the ids of its added tokens are the ones
    # it gives them, which a tokenizer.json need not record (tokenizers renumbers added tokens missing from the vocab).
    extended, first = vocabulary.extend_bpe_json(json.loads(base.backend_tokenizer.to_str()), pairs)
    tokenizer.copy(base_dir, folder, tuple(n for n in tokenizer.FILES if n not in tokenizer.VOCABULARY_FILES))
    (folder / "tokenizer.json").write_text(json.dumps(extended, ensure_ascii=False), encoding="utf-8")
    return first


def sub_tokens(base, extended, first: int) -> list[list[int]]:
    """The base tokenizer's ids for each new token's text: what "mean of sub-tokens" averages.

    The token's text is split by the base's BPE model directly (it lies inside one pre-tokenized word,
    in the model's own alphabet: byte-level characters, or SentencePiece's "▁" for spaces)."""
    model = base.backend_tokenizer.model
    pieces = extended.convert_ids_to_tokens(list(range(first, len(extended))))
    return [[t.id for t in model.tokenize(piece)] for piece in pieces]


# --------------------------------------------------------------------------------------------------
# Checks of an extended tokenizer (the acceptance list of notebook 02, as figures)
# --------------------------------------------------------------------------------------------------
def check_tokenizer(base_dir: str | Path, extended_dir: str | Path, texts: list[str]) -> dict[str, Any]:
    """Measure what an extension must preserve, on `texts`.

    Returns:
        old_ids_moved: old ids whose piece changed (must be 0); specials_moved (0);
        changed_without_new: texts whose extended tokenization has no new token but differs (0);
        not_concatenation: new tokens whose span is not a run of whole old-token spans (0);
        roundtrip_failures: texts where decode(encode(x)) != x (0).
    """
    base, extended = tokenizer.load(base_dir), tokenizer.load(extended_dir)
    first = read_extension(extended_dir).first_new
    old_vocab, new_vocab = base.get_vocab(), extended.get_vocab()
    moved = sum(1 for piece, i in old_vocab.items() if new_vocab.get(piece) != i)
    specials = len(moved_specials(base, extended))
    changed = spans = roundtrip = 0
    for text in texts:
        old = base(text, add_special_tokens=False, return_offsets_mapping=True)
        new = extended(text, add_special_tokens=False, return_offsets_mapping=True)
        if not any(i >= first for i in new.input_ids) and new.input_ids != old.input_ids:
            changed += 1
        boundaries = {0} | {end for _, end in old.offset_mapping} | {start for start, _ in old.offset_mapping}
        spans += sum(1 for i, (start, end) in zip(new.input_ids, new.offset_mapping)
                     if i >= first and not (start in boundaries and end in boundaries))
        roundtrip += extended.decode(new.input_ids) != text
    return {"texts": len(texts), "old_ids_moved": moved, "specials_moved": specials, "changed_without_new": changed,
            "not_concatenation": spans, "roundtrip_failures": roundtrip}


CHECKS = {"texts": "texts checked", "old_ids_moved": "old ids whose piece changed",
          "specials_moved": "special tokens whose id changed",
          "changed_without_new": "texts without a new token, tokenized differently",
          "not_concatenation": "new tokens that are not a run of whole old tokens",
          "roundtrip_failures": "texts that do not decode back to themselves"}
"""What each figure of `check_tokenizer` counts, for a reader (every count but `texts` must be 0)."""


def checks_markdown(results: dict[str, dict[str, Any]]) -> str:
    """`check_tokenizer` results side by side as a Markdown table: a row per check, a column per tokenizer."""
    head = "| | " + " | ".join(results) + " |\n|---|" + "---|" * len(results) + "\n"
    return head + "\n".join(f"| {label} | " + " | ".join(f"{r[key]:,}" for r in results.values()) + " |"
                             for key, label in CHECKS.items())


def compression(tokenizer_dir: str | Path, texts: list[str]) -> float:
    """Tokens per character of a tokenizer on `texts` (lower is better)."""
    texts = [t for t in inputs.listed(texts, "texts", "strings") if t]
    if not texts:
        raise ValueError("no texts to measure; pass at least one non-empty text.")
    hf = tokenizer.load(tokenizer_dir)
    tokens = sum(len(ids) for ids in hf(texts, add_special_tokens=False).input_ids)
    return tokens / sum(len(t) for t in texts)


# --------------------------------------------------------------------------------------------------
# Checkpoints: grow, score
# --------------------------------------------------------------------------------------------------
@nodes.node0_only
def grow(ckpt: str | Path, tokenizer_dir: str | Path, out: str | Path, *, init: str = "mean", seed: int = 0,
         overwrite: bool = False, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Grow a cookbook checkpoint to an extended tokenizer's vocabulary and save it (with that tokenizer)
    at `out`.

    Raises:
        ConfigError: the checkpoint's tokenizer is not the one the extension was made from, or its
            vocabulary size is not that tokenizer's; an unknown `init`.
    """
    from pai_cookbook.core.launching import launch

    if init not in INITS:
        raise ConfigError(f"init {init!r} is not one of {INITS}.")
    ckpt = checkpoint.resolve(ckpt)
    model, _ = checkpoint.read_config(ckpt)
    extension = read_extension(tokenizer_dir)
    assets = Path(ckpt) / checkpoint.HF_ASSETS
    found = tokenizer.fingerprint(assets)
    if found != extension.base_fingerprint:
        raise ConfigError(f"checkpoint {ckpt} carries a different tokenizer from the one {tokenizer_dir} extends "
                          f"({extension.base}); extend the checkpoint's own tokenizer ({assets}) instead.")
    if model.vocab_size != extension.base_size:
        raise ConfigError(f"checkpoint {ckpt} has vocab_size {model.vocab_size}, but its tokenizer has "
                          f"{extension.base_size} tokens; the extension's new ids would not follow the model's "
                          f"rows. Only checkpoints whose vocab_size is the tokenizer's length can be grown.")
    checkpoint.check_writable(out, overwrite)
    out = Path(out)
    run_dir = Path(run_dir or out.with_name(out.name + ".logs"))
    staged = run_dir / "assets"
    checkpoint.copy_assets(assets, staged)
    tokenizer.copy(tokenizer_dir, staged, tokenizer.FILES + (EXTENSION_FILE,))
    config = json.loads((staged / "config.json").read_text()) if (staged / "config.json").exists() else None
    if config is not None:
        config["vocab_size"] = extension.size
        (staged / "config.json").write_text(json.dumps(config, indent=2))
    job = GrowJob(src=str(Path(ckpt).resolve()), dst=str(out.resolve()), assets=str(staged.resolve()),
                  vocab_size=extension.size, sources=extension.sources, init=init, seed=seed)
    with checkpoint.worker_writes(out):
        result = launch.launch(job, run_dir=run_dir, echo=False, show_progress=False)
    return {k: v for k, v in result.items() if k != "events"}


@nodes.node0_only
def score(checkpoints: list[str | Path], texts: dict[str, list[str]], *, pairs: list[tuple[str, str, str]] = (),
          batch: int = 8, run_dir: str | Path = "runs/score") -> dict[str, Any]:
    """Bits per character of each checkpoint on each named text set (each under its own tokenizer), and
    for each (base, extended, text set) pair the extended model's logits against the base's.

    Returns:
        {"bits_per_char": {ckpt: {text set: bits}}, "pairs": [{max_abs_diff_old_entries, kl, new_mass,
        padding_mass, ...}]}
    """
    from pai_cookbook.core.launching import launch

    for base, extended, name in pairs:
        if name not in texts:
            raise ConfigError(f"pair ({base}, {extended}) names text set {name!r}; known: {sorted(texts)}.")
    resolved = {str(c): str(checkpoint.resolve(c)) for c in [*checkpoints, *(p for a, b, _ in pairs for p in (a, b))]}
    for ckpt in resolved.values():
        checkpoint.read_config(ckpt)
    job = ScoreJob(checkpoints=[resolved[str(c)] for c in checkpoints], texts=texts,
                   pairs=[[resolved[str(a)], resolved[str(b)], name] for a, b, name in pairs], batch=batch)
    result = launch.launch(job, run_dir=run_dir, echo=False, show_progress=False)
    given = {str(c): resolved[str(c)] for c in checkpoints}  # the results keep the names the caller gave
    return {k: v for k, v in result.items() if k != "events"} | {
        "bits_per_char": {name: result["bits_per_char"][path] for name, path in given.items()}}


def main(argv: list[str] | None = None) -> int:
    """CLI for batch jobs: learn + merge a tokenizer, or grow a checkpoint (exit code 2 on bad input)."""
    from pai_cookbook import data

    parser = argparse.ArgumentParser(prog="python -m pai_cookbook.extend", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    learn = commands.add_parser("tokenizer", help="learn new tokens from a corpus and merge them into BASE")
    learn.add_argument("base", type=Path, help="Hugging Face tokenizer folder (or model folder)")
    learn.add_argument("corpus", type=Path, nargs="+", help=".txt (a document per line) or .jsonl files")
    learn.add_argument("out", type=Path)
    learn.add_argument("--new-tokens", type=int, required=True)
    learn.add_argument("--overwrite", action="store_true")
    grow_cmd = commands.add_parser("grow", help="grow a cookbook checkpoint to an extended tokenizer")
    grow_cmd.add_argument("ckpt", type=Path)
    grow_cmd.add_argument("tokenizer", type=Path)
    grow_cmd.add_argument("out", type=Path)
    grow_cmd.add_argument("--init", choices=INITS, default="mean")
    grow_cmd.add_argument("--overwrite", action="store_true")
    opts = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        if opts.command == "grow":
            return grow(opts.ckpt, opts.tokenizer, opts.out, init=opts.init, overwrite=opts.overwrite)
        texts = [text for path in opts.corpus for text in data.read_documents(path)]
        return extend_tokenizer(opts.base, texts, opts.out, opts.new_tokens, overwrite=opts.overwrite).summary()
    return cli.finish("pai_cookbook.extend", work)


if __name__ == "__main__":
    sys.exit(main())
