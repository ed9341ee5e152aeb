"""Quantize a Hugging Face folder for serving: FP8, INT8 or INT4, with llm-compressor, into the compressed-tensors
format vLLM loads (and transformers reads, with the compressed-tensors package):

    quantize.quantize("outputs/06/hf", "outputs/13/int8", "int8", calibration_texts=corpus)
    with serve.Server("outputs/13/int8") as server: ...

The work runs in the serving environment (`serve.serving_python`), one process per call (`workers/quantize.py`),
checked here first: a folder that is not a Hugging Face model, an unknown scheme, a scheme that needs calibration
text given none, an output folder holding another model. The output appears whole or not at all, and a second call
with the same settings returns the first's record without redoing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pai_cookbook import serve
from pai_cookbook.core.configs.config import ConfigError
from pai_cookbook.core.launching import failures, inputs, lock, processes

__all__ = ["RECORD_FILE", "SCHEMES", "group_size_for", "quantize"]

RECORD_FILE = "pai_cookbook_quantized.json"
SCHEMES: dict[str, dict[str, Any]] = {
    "fp8": {"label": "FP8 W8A8", "weights_bits": 8, "calibration": False,
            "method": "weights per output channel, activations per token at run time (no calibration)",
            "gpu": "FP8 GEMMs on compute capability 8.9 and above (L20, L40S, H20, H100/H800, B200); on 8.0-8.6 "
                   "(A10, A100) vLLM keeps the FP8 weights and multiplies in bf16 (its Marlin weight-only kernel)"},
    "int8": {"label": "INT8 W8A8", "weights_bits": 8, "calibration": True,
             "method": "SmoothQuant (activation outliers moved into the weights), then GPTQ; activations per token "
                       "at run time",
             "gpu": "INT8 GEMMs on compute capability 7.5 and above (T4, A10, A100, L40S, H100)"},
    "int4": {"label": "INT4 W4A16", "weights_bits": 4, "calibration": True,
             "method": "GPTQ, symmetric 4-bit weights in groups along the input; activations in bf16",
             "gpu": "Marlin kernels on compute capability 8.0 and above"},
}
GROUP_SIZES = (128, 64, 32)
SCHEME_SETTINGS = ("scheme", "group_size", "smoothing", "dtype", "calibration_sequences", "calibration_tokens",
                   "calibration_sha256")


def _linear_inputs(config: dict[str, Any]) -> set[int]:
    """The input widths of a decoder's linear layers (what an INT4 group divides)."""
    config = config.get("text_config", config)
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    widths = {hidden, heads * head_dim}
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(key):
            widths.add(config[key])
    return widths


def group_size_for(folder: str | Path) -> int:
    """The largest of 128, 64 and 32 that divides every linear layer's input (SmolLM2's 576 takes 64)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    widths = _linear_inputs(config)
    for size in GROUP_SIZES:
        if all(w % size == 0 for w in widths):
            return size
    raise ConfigError(f"no INT4 group size of {GROUP_SIZES} divides the linear layers' inputs {sorted(widths)}; "
                      f"pass group_size= one that does.")


def _calibration(folder: Path, texts: Sequence[str] | None, samples: int, length: int) -> list[list[int]]:
    """`samples` sequences of `length` tokens cut from the texts joined by blank lines (fewer where the text ends)."""
    from transformers import AutoTokenizer

    if texts is None:
        return []
    texts = [t for t in inputs.listed(texts, "calibration_texts", "strings") if isinstance(t, str) and t.strip()]
    if not texts:
        raise ConfigError("calibration_texts holds no text; give paragraphs of what the model will serve (notebook "
                          "03's corpus by default in notebook 13).")
    ids = AutoTokenizer.from_pretrained(folder)("\n\n".join(texts))["input_ids"]
    return [ids[i:i + length] for i in range(0, len(ids), length)][:samples]


def quantize(hf_folder: str | Path, out: str | Path, scheme: str, *, calibration_texts: Sequence[str] | None = None,
             samples: int = 64, sequence_length: int = 512, group_size: int | None = None, smoothing: float = 0.8,
             dtype: str = "float32", timeout_s: float = 3600, python: str | Path | None = None) -> dict[str, Any]:
    """`hf_folder` quantized by `scheme` (`SCHEMES`) into `out`.

    Args:
        calibration_texts: what GPTQ and SmoothQuant see (INT8, INT4); FP8 needs none. Cut into `samples` sequences
            of `sequence_length` tokens.
        group_size: INT4's weights per scale; default `group_size_for` the model.
        dtype: what the model is loaded in to be quantized; the layers left as they are keep it.
    Returns:
        the record written into `out` (scheme, settings, calibration size), with "seconds" and "bytes" of the run
        that made it ("reused": True where `out` already held it).
    """
    source = serve.check_hf_model(hf_folder).resolve()
    if scheme not in SCHEMES:
        labels = ", ".join(s["label"] for s in SCHEMES.values())
        raise ConfigError(f"scheme={scheme!r}: the schemes are {sorted(SCHEMES)} ({labels}).")
    spec = SCHEMES[scheme]
    if spec["calibration"] and calibration_texts is None:
        raise ConfigError(f"{spec['label']} calibrates on text ({spec['method']}); pass calibration_texts, e.g. "
                          f"corpora.english() or your own corpus.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={dtype!r}: load the model in float32, bfloat16 or float16 to quantize it.")
    samples, sequence_length = inputs.integer(samples, "samples"), inputs.integer(sequence_length, "sequence_length")
    group = (inputs.integer(group_size, "group_size") if group_size else group_size_for(source)) if scheme == "int4" else None
    if group and any(w % group for w in _linear_inputs(json.loads((source / "config.json").read_text()))):
        raise ConfigError(f"group_size={group} does not divide every linear layer's input; `group_size_for` finds one.")
    python = Path(python) if python else serve.serving_python()
    overlay = python.parent.parent / "quantize"
    if not (overlay / "llmcompressor").exists():
        raise ConfigError(f"no llm-compressor beside the serving environment ({overlay}); run `bash ci/setup_env.sh "
                          f"serve`, which installs it there.")
    ids = _calibration(source, calibration_texts, samples, sequence_length) if spec["calibration"] else []
    out = Path(out).resolve()
    wanted = {"scheme": scheme, "group_size": group, "smoothing": smoothing if scheme == "int8" else None,
              "dtype": dtype, "calibration_sequences": len(ids), "calibration_tokens": sum(map(len, ids)),
              "calibration_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}
    with lock.hold(out, "quantization"):
        if out.exists():
            record_file = out / RECORD_FILE
            if record_file.exists():
                record = json.loads(record_file.read_text())
                if {k: record.get(k) for k in SCHEME_SETTINGS} == wanted and record.get("source") == str(source):
                    return record | {"reused": True}
            raise ConfigError(f"{out} already holds {'another quantization' if record_file.exists() else 'other files'}"
                              f"; it is kept. Give another output folder, or delete it to quantize again.")
        run_dir = out.with_name(out.name + ".run")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "result.json").unlink(missing_ok=True)
        job_file = run_dir / "job.json"
        job_file.write_text(json.dumps(wanted | {"source": str(source), "out": str(out), "calibration_ids": ids}))
        result = _run(python, overlay, job_file, run_dir / "quantize.log", timeout_s)
    record = json.loads((out / RECORD_FILE).read_text())
    return record | result | {"reused": False}


def _run(python: Path, overlay: Path, job_file: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    worker = Path(__file__).resolve().parent / "workers" / "quantize.py"
    env = {**os.environ, "PYTHONPATH": str(overlay), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)}
    started = time.monotonic()
    with processes.Signals(), open(log_path, "w") as log:
        proc = subprocess.Popen([str(python), str(worker), str(job_file)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=processes.death_signal())
        try:
            while proc.poll() is None:
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"quantization ran past timeout_s={timeout_s:g} and was stopped; log {log_path}")
                time.sleep(0.2)
        except BaseException:
            processes.terminate(proc)
            raise
    if proc.returncode != 0:
        raise failures.WorkerError(0, proc.returncode, failures.tail(log_path, failures.LOG_TAIL_LINES), log_path.parent)
    return json.loads(job_file.with_name("result.json").read_text())
