"""The quantization worker: one scheme of `pai_cookbook.quantize.SCHEMES` applied to a Hugging Face folder with
llm-compressor, saved in the compressed-tensors format that vLLM loads.

It runs in the serving environment (`bash ci/setup_env.sh serve`: vLLM and llm-compressor, without Megatron-Core),
started by path, not as a module of the package (the package's import checks Megatron-Core's version):

    .venv-serve/bin/python pai_cookbook/workers/quantize.py job.json

The job (`quantize.quantize` writes and checks it) names the source folder, the scheme, the calibration ids and the
output folder; the output is written into `<out>.partial` and renamed when complete, so a folder at `out` is always a
whole model. The run's figures go to `result.json` beside the job.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path


def recipe(scheme: str, group_size: int | None, smoothing: float):
    """llm-compressor modifiers for a scheme; the output head stays in the model's dtype (vLLM's and llm-compressor's
    examples keep it, and SmolLM2 ties it to the embedding, which is never quantized)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ignore = ["lm_head"]
    if scheme == "fp8":  # weights per output channel, activations per token at run time: no calibration
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore)]
    if scheme == "int8":  # SmoothQuant moves activation outliers into the weights, then GPTQ rounds them
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        return [SmoothQuantModifier(smoothing_strength=smoothing),
                GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if scheme == "int4":  # GPTQ, 4-bit symmetric weights in groups along the input; activations stay as they are
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
        return [GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                             ignore=ignore)]
    raise ValueError(f"unknown scheme {scheme!r}")


def main(job_file: str) -> int:
    job = json.loads(Path(job_file).read_text())
    torch_threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if torch_threads:
        torch.set_num_threads(torch_threads)
    started = time.monotonic()
    source, out = Path(job["source"]), Path(job["out"])
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, job["dtype"]))
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = job["calibration_ids"]
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}) if ids else None
    loaded = time.monotonic()
    oneshot(model=model, dataset=dataset, recipe=recipe(job["scheme"], job.get("group_size"), job["smoothing"]),
            max_seq_length=max((len(x) for x in ids), default=1), num_calibration_samples=len(ids),
            pipeline="datafree" if not ids else "sequential")
    quantized = time.monotonic()
    model.save_pretrained(partial, save_compressed=True)
    tokenizer.save_pretrained(partial)
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (source / extra).exists() and not (partial / extra).exists():
            shutil.copy2(source / extra, partial / extra)
    (partial / "pai_cookbook_quantized.json").write_text(json.dumps(  # what `quantize.quantize` compares on a rerun
        {k: job[k] for k in ("scheme", "source", "dtype", "group_size", "smoothing", "calibration_sequences",
                             "calibration_tokens", "calibration_sha256")}, indent=1))
    os.replace(partial, out)
    result = {"seconds": {"load": loaded - started, "quantize": quantized - loaded, "save": time.monotonic() - quantized},
              "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}
    Path(job_file).with_name("result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
