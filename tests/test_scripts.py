"""Benchmarks and CI helpers are not run by the test suite, but they must at least compile."""

import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").rglob("*.py")) + sorted((ROOT / "ci").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_compiles(script):
    py_compile.compile(str(script), doraise=True)
