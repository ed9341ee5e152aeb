"""Committed notebooks are stripped, papermill-ready and follow the cookbook's layout."""

import ast
import re

import nbformat
import pytest

from ci.run_notebooks import notebooks

NAME = re.compile(r"^\d\d_[a-z0-9]+(_[a-z0-9]+)*\.ipynb$")


@pytest.fixture(params=notebooks(), ids=lambda p: p.stem)
def notebook(request):
    return request.param, nbformat.read(request.param, as_version=4)


def test_valid_and_named_in_run_order(notebook):
    path, nb = notebook
    nbformat.validate(nb)
    assert NAME.match(path.name), f"{path.name}: name notebooks NN_verb_object.ipynb"


def test_committed_without_outputs(notebook):
    path, nb = notebook
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; run `nbstripout {path}` (it keeps tags)"


def test_first_cell_explains_second_is_the_only_parameters_cell(notebook):
    path, nb = notebook
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert tagged == [1], f"{path.name}: exactly the second cell must be tagged 'parameters', got {tagged}"


def test_parameters_are_commented_upper_case_constants(notebook):
    path, nb = notebook
    source = nb.cells[1].source
    names = [t.id for node in ast.parse(source).body for t in node.targets]
    assert names and all(n.isupper() for n in names) and "OUTPUT_DIR" in names
    for line in source.splitlines():
        assert "#" in line, f"{path.name}: parameter line without a comment (units, CI vs real value): {line}"
    # papermill lists the parameters a notebook takes (papermill --help-notebook) only when it can parse
    # each line: one "=" a line, none in the comment.
    from papermill.translators import PythonTranslator

    seen = [p.name for p in PythonTranslator.inspect(nb.cells[1])]
    assert seen == names, f"{path.name}: papermill cannot read {sorted(set(names) - set(seen))}; no '=' in comments"


def test_ci_overrides_name_parameters_the_notebook_has():
    """CI runs 01, 03, 06 and 07 with ci/run_notebooks.TINY instead of their SmolLM2 defaults: each name there must
    be a parameter of its notebook (papermill would inject a misspelt one as a new variable, and CI would run SmolLM2
    for an hour), and each overridden notebook must default to the real model."""
    from ci.run_notebooks import TINY

    by_stem = {p.stem: p for p in notebooks()}
    assert set(TINY) <= set(by_stem)
    for stem, overrides in TINY.items():
        cell = nbformat.read(by_stem[stem], as_version=4).cells[1]
        defaults = {t.id: ast.literal_eval(node.value) for node in ast.parse(cell.source).body for t in node.targets}
        assert set(overrides) <= set(defaults), f"{stem}: {sorted(set(overrides) - set(defaults))} are not parameters"
        assert defaults["REAL_MODEL"] is True and overrides["REAL_MODEL"] is False, stem


POINTER = re.compile(r"(docs/[\w.-]+\.md|README(?:\.md|'s table)?)\s+has\s+(?:the|its)\s+(\w+)")
SPEED_VERDICT = re.compile(r"\b(?:is|are|was|were|ran|runs)\s+(?:\w+\s+){0,2}(?:slower|faster)\s+than\b", re.I)


def test_a_pointer_names_the_file_that_holds_what_it_promises(notebook):
    """"docs/notebook-figures.md has the minutes": the file named holds a table with that column. (The notebooks once
    sent readers to the README's table for minutes it did not have.)"""
    path, nb = notebook
    root = path.parents[1]
    for cell in nb.cells:  # markdown, and the comments of code cells (the parameters' notes)
        for target, word in POINTER.findall(cell.source):
            file = root / ("README.md" if target.startswith("README") else target)
            headers = [line for line in file.read_text(encoding="utf-8").splitlines()
                       if line.startswith("|") and not set(line) <= set("|-: ")]
            assert any(re.search(rf"\|\s*{word}\s*\|", line, re.I) for line in headers), \
                f"{path.name}: says {target} has the {word}, but no table there has a {word!r} column"


def test_no_speed_verdict_in_prose(notebook):
    """Which run was faster is a measurement of this run on this machine (on a shared CPU, load swings a step's
    tokens/s tenfold): a cell prints it from the runs' medians (`report.speed_comparison`), the prose does not fix it.
    (Notebook 00 said tensor parallelism was slower while its run printed it three times faster.)"""
    path, nb = notebook
    said = [m.group() for cell in nb.cells if cell.cell_type == "markdown" for m in SPEED_VERDICT.finditer(cell.source)]
    assert not said, f"{path.name}: {said}"
