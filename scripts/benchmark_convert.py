"""Benchmark checkpoint conversion: time and peak memory in both directions, next to a plain `cp`.

    python scripts/benchmark_convert.py [--workdir /tmp/convert-bench] [--shard-size 200MB] [--layers 8 16]

Builds Llama-style Hugging Face checkpoints (bf16, width 2048, vocab 32000) of 8 and 16 layers
(~0.9 and ~1.6 GiB) in 200 MB shards, then prints, per size and direction: the whole call's seconds (as
a notebook cell sees them: the worker's start included; median of --runs), seconds inside the worker
(median), seconds of `cp -r` of the same files (median), and the worker's largest peak RSS next to its RSS right
after importing torch and Megatron-Core and the largest shard. From the two sizes: the marginal throughput (the
extra bytes over the worker's extra seconds: the start of a fresh process varies by +-0.5 s between calls, and
only adds noise to a difference) and the fixed seconds (what a whole call of zero bytes would take), for the
conversion and for `cp`; the last line is the ratio of marginal throughputs, conversion / `cp`, per
direction. Memory should not grow with the model (conversion streams one parameter at a time).
Not a test: figures depend on the disk and the page cache (the files were just written, so both the
conversion and `cp` read them from cache).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH_CONFIG = {"num_hidden_layers": 8, "hidden_size": 2048, "intermediate_size": 5504, "num_attention_heads": 16,
                "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def timed(run: Callable[[], Any], output: Path, runs: int) -> tuple[float, list[Any]]:
    """Median seconds of `runs` calls writing `output`, and every call's result. Before each call, outside the
    timing, the previous call's output is deleted and dirty pages are written back (`sync`): without that, `cp` of
    the same 1.6 GiB took 0.5 s or 4.5 s."""
    seconds, results = [], []
    for _ in range(runs):
        shutil.rmtree(output, ignore_errors=True)
        os.sync()
        start = time.perf_counter()
        results.append(run())
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), results


def cp(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/convert-bench"))
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--layers", type=int, nargs=2, default=[8, 16], help="two model sizes, in layers")
    parser.add_argument("--runs", type=int, default=3, help="timings per figure (their median is printed)")
    opts = parser.parse_args()
    print(f"{'model':26s} {'direction':16s} {'call s':>7s} {'worker s':>8s} {'cp s':>6s} {'peak RSS MB':>12s} "
          f"{'RSS after imports':>18s} {'largest shard MB':>17s}")
    small, large = (bench_one(opts.workdir / f"layers{n}", n, opts.shard_size, opts.runs) for n in opts.layers)
    ratios = []
    for direction in small:
        (b1, t1, w1, cp1), (b2, t2, w2, cp2) = small[direction], large[direction]
        # The marginal rate from the worker's own seconds: a fresh process's start (+-0.5 s between calls here)
        # is the same work at both sizes and would only add noise to the difference.
        mb_s, cp_mb_s = (b2 - b1) / (w2 - w1) / 2**20, (b2 - b1) / (cp2 - cp1) / 2**20
        # what the whole call spends beyond the marginal rate, averaged over the two sizes
        fixed = (t1 + t2 - (b1 + b2) / 2**20 / mb_s) / 2
        cp_fixed = cp1 - (b1 / 2**20) / cp_mb_s
        print(f"{direction:16s} marginal {mb_s:6.0f} MB/s (cp {cp_mb_s:5.0f}), fixed {fixed:5.2f} s (cp {cp_fixed:5.2f})")
        ratios.append(f"{direction} {mb_s / cp_mb_s:.2f}x")
    print("marginal throughput, conversion / cp: " + ", ".join(ratios))


def bench_one(work: Path, layers: int, shard_size: str, runs: int) -> dict[str, tuple[int, float, float, float]]:
    """(bytes read, seconds of the whole call, seconds inside the worker, seconds of cp) per direction (medians),
    after printing its rows."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pai_cookbook import convert

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hf = work / "hf"
    model = AutoModelForCausalLM.from_config(LlamaConfig(**BENCH_CONFIG | {"num_hidden_layers": layers}),
                                             dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf, max_shard_size=shard_size)
    del model
    source = convert.inspect_hf(hf)
    largest_mb = source.largest_shard_bytes / 2**20
    label = f"{params / 1e6:.0f}M, {folder_bytes(hf) / 2**30:.2f} GiB, {len(list(hf.glob('*.safetensors')))} shards"

    rows, sizes = {}, {}
    cp_hf, _ = timed(lambda: cp(hf, work / "cp_hf"), work / "cp_hf", runs)
    call_s, to_mcore = timed(lambda: convert.hf_to_megatron(hf, work / "mcore", require_tokenizer=False,
                                                            run_dir=work / "logs1"), work / "mcore", runs)
    rows["HF -> Megatron"] = (to_mcore, call_s, cp_hf)
    sizes["HF -> Megatron"] = folder_bytes(hf)
    cp_mcore, _ = timed(lambda: cp(work / "mcore", work / "cp_mcore"), work / "cp_mcore", runs)
    call_s, to_hf = timed(lambda: convert.megatron_to_hf(work / "mcore", work / "hf_back",
                                                         max_shard_bytes=source.largest_shard_bytes,
                                                         run_dir=work / "logs2"), work / "hf_back", runs)
    rows["Megatron -> HF"] = (to_hf, call_s, cp_mcore)
    sizes["Megatron -> HF"] = folder_bytes(work / "mcore")
    worker_s = {name: statistics.median(r["seconds"] for r in results) for name, (results, _, _) in rows.items()}
    for name, (results, call_s, cp_s) in rows.items():
        print(f"{label:26s} {name:16s} {call_s:7.2f} {worker_s[name]:8.2f} {cp_s:6.2f} "
              f"{max(r['peak_rss_mb'] for r in results):12.0f} {results[-1]['rss_before_mb']:18.0f} {largest_mb:17.0f}")
    identical = convert.compare_hf_checkpoints(hf, work / "hf_back")["bitwise_identical"]
    print(f"{label:26s} round trip bitwise identical: {identical}")
    shutil.rmtree(work)
    return {name: (sizes[name], call_s, worker_s[name], cp_s) for name, (_, call_s, cp_s) in rows.items()}


if __name__ == "__main__":
    main()
