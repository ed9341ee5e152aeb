"""Benchmark SFT packing: real (non-padding) tokens per second, packed rows against one conversation per row.

    python scripts/benchmark_sft_packing.py [--workdir /tmp/sft-bench] [--steps 20] [--seq-length 512]

Prepares the cookbook's instruction set (data/sft/arithmetic.jsonl: 1-6 turns, so lengths are skewed) for
a tiny Llama with SmolLM2's vocabulary twice, packed and padded, trains each for the same number of steps
of the same shape (2 rows of --seq-length) in one launch (`train.sweep`), and prints per layout: the share
of real tokens, seconds per step, real tokens per second, and the packed/padded ratio. Every position
costs the same compute whether it holds a token or padding, so the ratio follows the real-token shares
(minus the block-diagonal mask's cost). Not a test: seconds depend on the machine and what else runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pai_cookbook import convert, sft, train
from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import CheckpointConfig, DataConfig, OptimizerConfig, RunConfig
from pai_cookbook.fixtures import smollm2, tiny_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/sft-bench"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--rows", type=int, default=2, help="rows per step (micro-batch = global batch)")
    opts = parser.parse_args()
    start = opts.workdir / "start"
    if not (start / checkpoint.CONFIG_FILE).exists():
        hf = tiny_models.make_tiny_hf_model("llama", opts.workdir / "hf", tokenizer_dir=smollm2.hf_folder(),
                                            chat_template=sft.CHATML, max_position_embeddings=opts.seq_length)
        convert.hf_to_megatron(hf, start)
    model, _ = checkpoint.read_config(start)
    runs, shares = {}, {}
    for name, packed in (("packed", True), ("padded", False)):
        folder = opts.workdir / name
        summary = sft.prepare(sft.DEFAULT_SET, folder, start / checkpoint.HF_ASSETS, seq_length=opts.seq_length,
                              packed=packed, valid_fraction=0.0)
        shares[name] = summary["train"]["efficiency"]
        runs[name] = RunConfig(model=model, optimizer=OptimizerConfig(lr=1e-3),
                               data=DataConfig(source="sft", paths=[str(folder)], seq_length=opts.seq_length,
                                               micro_batch_size=opts.rows, global_batch_size=opts.rows),
                               checkpoint=CheckpointConfig(load_dir=str(start)), train_iters=opts.steps, eval_interval=0)
    results = train.sweep(runs, run_dir=opts.workdir / "runs", show_progress=False, echo=False)
    positions = opts.rows * opts.seq_length
    print(f"{'layout':8s} {'real tokens':>12s} {'s/step':>8s} {'real tokens/s':>14s}")
    speed = {}
    for name, result in results.items():
        seconds = positions / result["tokens_per_s"]  # tokens_per_s counts every position of the rows
        speed[name] = positions * shares[name] / seconds
        print(f"{name:8s} {shares[name]:12.1%} {seconds:8.3f} {speed[name]:14,.0f}")
    print(f"packed / padded real tokens per second: {speed['packed'] / speed['padded']:.2f}x")


if __name__ == "__main__":
    main()
