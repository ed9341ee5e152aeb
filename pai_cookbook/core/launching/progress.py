"""Progress bars that read well in a notebook's saved copy.

In a notebook `tqdm.auto` draws a widget. A notebook run by papermill (CI, a PAI-DLC batch job) is saved without
the widgets' state, so its copy shows each bar as the text it had when it was first drawn: "train:   0%|  | 0/500".
`bar` draws the same widget under a display id and, when it closes, replaces that output with the bar's last line
("train: 100%|██████████| 500/500 [00:12<00:00, 40.1it/s, loss=0.23]"): live while it runs, its outcome once done,
in the notebook and in the saved copy. Outside a notebook it is tqdm's text bar.

`quiet_transformers()` turns transformers' own bars ("Loading weights", "Writing model shards") off while the
cookbook loads or saves a Hugging Face model for its own purposes; in a saved copy each of those reads 0% too.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any


def bar(total: int | None = None, desc: str | None = None, **kwargs: Any):
    """`tqdm.auto.tqdm(total=..., desc=..., **kwargs)` on stdout, whose notebook widget turns into its final line
    when it is closed."""
    from tqdm.auto import tqdm

    kwargs.setdefault("file", sys.stdout)
    if kwargs.get("disable") or not _in_notebook(tqdm):
        return tqdm(total=total, desc=desc, **kwargs)
    return _notebook_bar()(total=total, desc=desc, **kwargs)


def _in_notebook(tqdm_class: type) -> bool:
    from tqdm.notebook import tqdm_notebook

    return issubclass(tqdm_class, tqdm_notebook)


@functools.cache
def _notebook_bar() -> type:
    from IPython.display import display
    from tqdm.notebook import tqdm_notebook

    class NotebookBar(tqdm_notebook):
        """tqdm's widget, displayed under a display id that its last line replaces on close."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, display=False, **kwargs)
            self._handle = None if self.disable else display(self.container, display_id=True)

        def close(self) -> None:
            handle, self._handle = getattr(self, "_handle", None), None
            line = None if handle is None else str(self)  # before close(), which stops the clock
            super().close()
            if handle is not None:
                handle.update({"text/plain": line}, raw=True)

    return NotebookBar


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off inside the block (restored after, if they were on), its GGUF reader's too
    (`modeling_gguf_pytorch_utils` draws a plain tqdm bar that transformers' switch does not reach)."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    gguf_bar = gguf.tqdm
    gguf.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        gguf.tqdm = gguf_bar
        if was_on:
            logging.enable_progress_bar()
