"""Execute the cookbook's notebooks with papermill: executed copies, figures and metrics per notebook.

    python ci/run_notebooks.py --out outputs                 # every notebook with its defaults
    python ci/run_notebooks.py --out outputs --tiny          # 01, 03, 06 and 07 on tiny models too (what CI runs)
    python ci/run_notebooks.py --out outputs --only 00       # notebooks whose name starts with 00
    python ci/run_notebooks.py --out outputs -p TRAIN_ITERS 200   # override a parameter everywhere it exists

Each notebook runs with its own folder as working directory and OUTPUT_DIR=<out>/<notebook stem>;
the executed copy is written to <out>/<notebook name>. This is how a PAI-DLC batch job runs them too.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "python3"

# Notebooks 01, 03, 06, 07, 10, 11 and 12 run SmolLM2-135M-Instruct, a real trained model, by default; these
# parameters run them on tiny random models instead, a minute or two each on 2 CPU cores: what CI runs
# (tests/test_notebooks.py) and `--tiny` gives. Each notebook says what its tiny run can and cannot show; the others
# are tiny by default (their points need many runs: 02, 04, 05, 08) or need no model (09).
TINY: dict[str, dict] = {
    "01_convert_checkpoint": {"REAL_MODEL": False},
    "03_continued_pretraining": {"REAL_MODEL": False, "LR": 3e-3, "MIN_LR": 3e-4, "TRAIN_ITERS": 200, "WARMUP_ITERS": 20,
                                 "EVAL_INTERVAL": 20},
    "06_supervised_finetuning": {"REAL_MODEL": False, "LR": 3e-3, "MIN_LR": 3e-4, "TRAIN_ITERS": 100, "WARMUP_ITERS": 10,
                                 "EVAL_INTERVAL": 25},
    "07_inference": {"REAL_MODEL": False, "TP_SIZE": 2, "MAX_NEW_TOKENS": 32},
    "10_lora": {"REAL_MODEL": False, "TRAIN_ITERS": 30, "LORA_LR": 1e-2, "FULL_LR": 3e-3},
    "11_evaluate": {"REAL_MODEL": False, "MMLU_PER_SUBJECT": 1, "CLOZE_ITEMS": 24, "TEXTS": 12,
                    "TENSOR_PARALLEL": 2},
    "12_preference_tuning": {"REAL_MODEL": False, "PAIRS": 128, "STEPS": 16, "LR": 1e-3, "VARIANTS": ["DPO", "SimPO"],
                             "JUDGED": [], "HELD_OUT": 32, "SFT_STEPS": 10, "SFT_LR": 3e-3,
                             "DPO_LR": 1e-4, "COMPARE_RATES": True,
                             "PAIRS_PER_STEP": 16},
    "13_deploy": {"REAL_MODEL": False, "CALIBRATION_SAMPLES": 16, "CALIBRATION_LENGTH": 256, "TEXTS": 12,
                  "CLOZE_ITEMS": 24, "MMLU_PER_SUBJECT": 1, "MAX_TOKENS": 32},
}


def notebooks(only: str | None = None) -> list[Path]:
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if only is None or p.name.startswith(only))


def _ipc_kernel_manager(folder: Path) -> type:
    """jupyter_client's kernel manager with the kernel's sockets as files in `folder` instead of TCP ports on
    127.0.0.1. Over TCP the manager picks five free ports and the kernel binds them a moment later; a torchrun or
    gloo rendezvous started meanwhile by a job beside it (CI's other pytest session) can take one, and the kernel
    dies before it starts ("Address already in use", seen once in CI)."""
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.transport = "ipc"
            self.ip = str(folder / "ipc")  # the sockets' path prefix (a socket path has ~107 bytes: keep it short)

    return IPCKernelManager


def execute_notebook(notebook: Path, out: Path, parameters: dict | None = None) -> Path:
    """Run one notebook; returns its output folder (holding metrics.json and figures).

    Raises:
        papermill.PapermillExecutionError: a cell failed; the executed copy shows which.
    """
    import papermill

    out = out.resolve()
    output_dir = out / notebook.stem
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        papermill.execute_notebook(
            str(notebook), str(out / notebook.name),
            parameters={"OUTPUT_DIR": str(output_dir), **(parameters or {})},
            cwd=str(notebook.parent), kernel_name=KERNEL, progress_bar=False, log_output=False,
            kernel_manager_class=_ipc_kernel_manager(Path(sockets)),
        )
    return output_dir


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs"))
    parser.add_argument("--only", help="run notebooks whose file name starts with this")
    parser.add_argument("--tiny", action="store_true", help="run 01, 03, 06 and 07 on tiny models (TINY), as CI does")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="override a parameter (Python literal)")
    opts = parser.parse_args(argv)
    params = {name: _literal(value) for name, value in opts.p}
    summary_path = opts.out / "summary.json"
    # merged into an earlier summary of the same folder: runs of one notebook at a time add up
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for notebook in notebooks(opts.only):
        start = time.perf_counter()
        print(f"== {notebook.name}", flush=True)
        output_dir = execute_notebook(notebook, opts.out, (TINY.get(notebook.stem, {}) if opts.tiny else {}) | params)
        metrics_path = output_dir / "metrics.json"
        summary[notebook.stem] = {"minutes": round((time.perf_counter() - start) / 60, 2),
                                  "metrics": json.loads(metrics_path.read_text()) if metrics_path.exists() else None,
                                  "figures": sorted(p.name for p in output_dir.glob("*.png"))}
        print(json.dumps(summary[notebook.stem], indent=2), flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    print(f"executed {len(notebooks(opts.only))} notebook(s); copies, figures and metrics in {opts.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
