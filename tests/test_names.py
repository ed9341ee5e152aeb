"""Every dotted name the project cites in backticks (docs, README, notebook markdown, docstrings and comments) exists:
`core.modeling.attention.LatentSelfAttention`, `workers.engine.token_logprobs`, `pai_cookbook.convert.hf_to_megatron`. A name
is checked when it starts with one of the package's own modules or subpackages (a file name such as `convert.py` is
not a name); old names kept as history are written in quotes, not backticks (docs/cpu-history.md)."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pai_cookbook

PACKAGE = Path(pai_cookbook.__file__).parent
REPO = PACKAGE.parent
FILE_SUFFIXES = {"py", "png", "json", "jsonl", "jinja", "md", "txt", "ipynb", "sh", "toml", "yml", "pt", "gguf",
                 "safetensors", "distcp", "partial", "bin"}
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(PACKAGE)]))
NAME = re.compile(r"`(pai_cookbook(?:\.[A-Za-z_]\w*)+|(?:" + "|".join(MODULES) + r")(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def _resolves(name: str) -> bool:
    if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return True
    parts = name.split(".")
    parts = parts if parts[0] == "pai_cookbook" else ["pai_cookbook", *parts]
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _texts() -> dict[str, str]:
    texts = {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in [REPO / "README.md",
                                                                              *(REPO / "docs").glob("*.md")]}
    for nb in (REPO / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        texts[str(nb.relative_to(REPO))] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        where = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(source)):  # docstrings, and the strings that document a field or a constant
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                texts[f"{where}:{node.lineno}"] = node.value.value
        texts[f"{where} (comments)"] = "\n".join(line for line in source.splitlines() if line.strip().startswith("#"))
    return texts


def test_every_cited_name_exists():
    missing = sorted({(m.group(1), where) for where, text in _texts().items() for m in NAME.finditer(text)
                      if not _resolves(m.group(1))})
    assert not missing, missing


# A file of this repository, cited by its path (not in quotes: an old one; not after "'s ": another project's).
PATH = re.compile(r"(?<![\w/.\"-])(?<!'s `)((?:docs|scripts|ci|tests|notebooks|pai_cookbook|data)/[\w./-]*"
                  r"\.(?:md|py|sh|ipynb|toml|yml|txt))\b")


def test_every_cited_repository_path_exists():
    """Paths such as docs/planning.md, scripts/benchmark_train.py, pai_cookbook/core/machine/compat.py."""
    missing = sorted({(m.group(1), where) for where, text in _texts().items() for m in PATH.finditer(text)
                      if not (REPO / m.group(1)).exists()})
    assert not missing, missing
