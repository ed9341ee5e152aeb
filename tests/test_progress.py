"""core.launching.progress: in a notebook's saved copy each of the cookbook's bars reads as its last line, not as the 0% it
was first drawn at; transformers' bars are off only inside `quiet_transformers`."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from pai_cookbook.core.launching import progress

CELL = """
from pai_cookbook.core.launching import progress

done = progress.bar(total=3, desc="finished")
for _ in range(3):
    done.update(1)
done.close()
stopped = progress.bar(total=3, desc="stopped")
stopped.update(1)
stopped.close()
"""


def test_a_saved_notebook_shows_each_bar_as_it_ended(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    NotebookClient(notebook, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[0].outputs
    assert [o.output_type for o in outputs] == ["display_data", "display_data"], outputs
    finished, stopped = (o.data["text/plain"] for o in outputs)
    # Drawn as widgets (what tqdm.auto picks in a kernel with ipywidgets), replaced by their last lines.
    assert all("application/vnd.jupyter.widget-view+json" not in o.data for o in outputs)
    assert finished.startswith("finished: 100%|") and "3/3 [" in finished, finished
    assert stopped.startswith("stopped:  33%|") and "1/3 [" in stopped, stopped


def test_outside_a_notebook_it_is_a_text_bar(capsys):
    from tqdm.notebook import tqdm_notebook

    bar = progress.bar(total=2, desc="text")
    assert not isinstance(bar, tqdm_notebook)
    bar.update(2)
    bar.close()
    assert "text: 100%" in capsys.readouterr().out


def test_quiet_transformers_restores_what_it_found():
    from transformers.utils import logging

    assert logging.is_progress_bar_enabled()
    with progress.quiet_transformers():
        assert not logging.is_progress_bar_enabled()
    assert logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        with progress.quiet_transformers():
            pass
        assert not logging.is_progress_bar_enabled()  # a caller's own choice stays
    finally:
        logging.enable_progress_bar()


def test_quiet_transformers_silences_the_gguf_readers_bar_and_restores_it():
    """transformers' GGUF reader draws a plain tqdm bar that its own progress switch does not reach: a notebook that
    made SmolLM2's folder on a fresh cache kept it at 0% (notebook 02 in CI on a clean cache)."""
    from transformers import modeling_gguf_pytorch_utils as gguf

    from pai_cookbook.core.launching.progress import quiet_transformers

    original = gguf.tqdm
    with quiet_transformers():
        assert gguf.tqdm([1, 2], desc="Converting and de-quantizing GGUF tensors...").disable
    assert gguf.tqdm is original
