"""Benchmark serving: generated tokens/s and time to first token of vLLM's server for a model folder and its quantized
copies, 1, 4 and 16 requests at once, each against the first folder (the unquantized model).

    python scripts/benchmark_serve.py bf16=outputs/13_deploy/../hf fp8=outputs/13_deploy/fp8 int8=... int4=...
    python scripts/benchmark_serve.py --smollm2 outputs/13_deploy      # SmolLM2 and notebook 13's three folders
    python scripts/benchmark_serve.py ... --device cuda                # a GPU image's vLLM (PAI_COOKBOOK_SERVE_PYTHON)

Each folder is served once (`serve.Server`, bf16), given one warm-up request, then `serve.throughput`: `--rounds` waves
of c streamed chat requests of exactly `--max-tokens` tokens for each c. Prints one row per folder and c, then each
folder's ratio to the first at the largest c. Start-up seconds are printed apart (not in tokens/s). Not a test: on a
2-core VM with anything else running the figures move by tens of percent; run it alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pai_cookbook import serve

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence.",
           "List three prime numbers.", "How do I reverse a list in Python?", "What is 12 times 12?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", help="name=folder, the reference first")
    parser.add_argument("--smollm2", type=Path, help="notebook 13's OUTPUT_DIR: SmolLM2 and its fp8, int8, int4 folders")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    folders = dict(item.split("=", 1) for item in args.folders)
    if args.smollm2:
        from pai_cookbook.fixtures import smollm2

        folders = {"bf16": smollm2.hf_folder()} | {s: args.smollm2 / s for s in ("fp8", "int8", "int4")}
    if not folders:
        parser.error("name=folder pairs, or --smollm2 OUTPUT_DIR")
    extra = ["--gpu-memory-utilization", "0.8"] if args.device == "cuda" else []
    rows = {}
    print(f"{'model':>6} {'at once':>8} {'tokens/s':>10} {'first token s':>14} {'slowest s':>10}")
    for name, folder in folders.items():
        with serve.Server(folder, log=Path(folder).with_name(f"{Path(folder).name}.bench.log"), extra_args=extra) as s:
            rows[name] = serve.throughput(s, PROMPTS, concurrency=args.concurrency, max_tokens=args.max_tokens,
                                          rounds=args.rounds)
            started = s.startup_s
        for r in rows[name]:
            print(f"{name:>6} {r['concurrency']:>8} {r['tokens_per_s']:>10.1f} {r['ttft_s']:>14.2f} {r['ttft_max_s']:>10.2f}")
        print(f"{name:>6} ready after {started:.0f} s")
    top = max(args.concurrency)
    reference = next(iter(rows))
    base = next(r["tokens_per_s"] for r in rows[reference] if r["concurrency"] == top)
    print(f"at {top} requests at once, against {reference}: " + ", ".join(
        f"{n} {next(r['tokens_per_s'] for r in rs if r['concurrency'] == top) / base:.2f}x" for n, rs in rows.items()))


if __name__ == "__main__":
    main()
