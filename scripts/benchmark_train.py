"""Benchmark training throughput: the cookbook's worker vs a minimal raw Megatron-Core loop vs Hugging
Face `LlamaForCausalLM` with a plain PyTorch loop; same model, batch and precision, in one run.
Also: data.prepare's tokens/s vs the tokenizer's own batch call.

    python scripts/benchmark_train.py [--steps 12] [--seq 256] [--batch 8] [--repeats 3]
    python scripts/benchmark_train.py --device cuda     # a GPU: the 1B shape in bf16 (ci/gpu.sh runs it)

Each figure is the median step time after 2 warm-up steps, as tokens/s. The cookbook's worker and transformers
run in turns, `--repeats` pairs (the second of each pair first in every other pair), and the last line is the
median of the pairs' ratios: on a 2-core VM a run's speed drifts by 10-30% within minutes, so runs far apart
compare the machine's moods more than the programs. Not a test: it prints figures rather than asserting on them.

On a GPU (`--device cuda`) the model is Llama-3.2-1B's shape (16 layers x 2,048, GQA 32/8 heads, 128,256-token
vocabulary), bf16, sequences of 2,048, micro-batch 4, global batch 8, synthetic tokens: the cookbook's worker (its
layers as `core.machine.build.choose_layers` decides there) against transformers + PyTorch (fp32 weights under bf16
autocast, SDPA, fused AdamW) eager and under `torch.compile`; the ratios come last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# An 8-layer Llama-style model, 512 wide, GQA 8/4 heads, 8k vocabulary: about 30M parameters.
BENCH_MODEL = {"num_hidden_layers": 8, "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
               "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 1024}
# Llama-3.2-1B's shape (random weights): what the GPU mode trains.
GPU_MODEL = {"num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 2048,
             "tie_word_embeddings": True, "rope_theta": 500000.0}
GPU_SEQ, GPU_MICRO_BATCH, GPU_BATCH = 2048, 4, 8


def cookbook(config, steps: int, work: Path) -> float:
    from pai_cookbook import train

    train.run(config, run_dir=work / "cookbook", show_progress=False, echo=False)
    lines = [json.loads(x) for x in (work / "cookbook" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(x["tokens_per_s"] for x in lines[2:])


def raw_megatron(config, steps: int, work: Path) -> float:
    from pai_cookbook.core.machine import runtime

    path = config.save(work / "raw.json")
    env = runtime.detect_launch_env()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
                          env.master_addr, "--master-port", str(env.master_port),
                          str(HERE / "bench_workers" / "raw_mcore.py"), str(path), str(steps)],
                         capture_output=True, text=True, check=True,
                         env=os.environ | {"OMP_NUM_THREADS": str(os.cpu_count()), "PYTHONWARNINGS": "ignore"})
    step_s = json.loads(out.stdout.strip().splitlines()[-1])["median_step_s"]
    return config.data.global_batch_size * config.data.seq_length / step_s


def hugging_face(config, steps: int, device: str = "cpu", compiled: bool = False) -> float:
    """transformers' Llama with a plain PyTorch loop on the same shape and batch: fp32 on a CPU; on a GPU fp32 weights
    under bf16 autocast with fused AdamW (and `torch.compile` when `compiled`)."""
    from transformers import AutoModelForCausalLM

    from pai_cookbook.core.checkpoints import families

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(families.to_hf(config.model), attn_implementation="sdpa").to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr, fused=device == "cuda")
    forward = torch.compile(model) if compiled else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    d = config.data
    tokens = torch.randint(0, config.model.vocab_size, (d.micro_batch_size, d.seq_length), device=device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        for _ in range(d.global_batch_size // d.micro_batch_size):
            with autocast:
                loss = forward(tokens, labels=tokens).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.clip_grad)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return d.global_batch_size * d.seq_length / statistics.median(times[2:])


def on_gpu(opts) -> None:
    """The GPU mode (module doc): the cookbook's worker, transformers eager and compiled, the ratios last."""
    from pai_cookbook.core.checkpoints import families
    from pai_cookbook.core.configs.config import DataConfig, OptimizerConfig, PrecisionConfig, RunConfig
    from pai_cookbook.core.machine import runtime

    device = runtime.detect_device()
    model = families.from_hf(families.tiny_hf_config("llama", **GPU_MODEL))
    config = RunConfig(model=model, precision=PrecisionConfig(dtype="bf16"), train_iters=opts.steps,
                       data=DataConfig(seq_length=GPU_SEQ, micro_batch_size=GPU_MICRO_BATCH, global_batch_size=GPU_BATCH),
                       optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5))
    with tempfile.TemporaryDirectory() as tmp:
        ours = cookbook(config, opts.steps, Path(tmp))
        lines = [json.loads(x) for x in (Path(tmp) / "cookbook" / "metrics.jsonl").read_text().splitlines()]
    eager = hugging_face(config, opts.steps, "cuda")
    compiled = hugging_face(config, opts.steps, "cuda", compiled=True)
    mfu = statistics.median(x["mfu"] for x in lines[2:]) if lines[2]["mfu"] is not None else None
    print(f"{device.name}, layers {device.layers}: Llama-3.2-1B shape, bf16, {GPU_BATCH} x {GPU_SEQ} tokens a step, "
          f"{opts.steps} steps (median after 2 warm-up)")
    print(f"  cookbook worker                 {ours:10,.0f} tokens/s (MFU against the datasheet: "
          f"{'unknown GPU' if mfu is None else f'{mfu:.2f}'})")
    print(f"  transformers + PyTorch, eager   {eager:10,.0f} tokens/s")
    print(f"  transformers + torch.compile    {compiled:10,.0f} tokens/s")
    print(f"cookbook / transformers eager: {ours / eager:.2f}x; cookbook / transformers compiled: {ours / compiled:.2f}x")


def preprocessing(work: Path) -> tuple[float, float, float]:
    """data.prepare's tokens/s on its first call in this process (Megatron-Core's import included: what a notebook
    kernel's first call sees) and on a second, and the tokenizer's own batch call's."""
    from transformers import AutoTokenizer

    from pai_cookbook import data
    from pai_cookbook.core.text.tokenizer import make_tokenizer

    make_tokenizer(256).save_pretrained(work / "tok")
    corpus = data.write_default_corpus(work / "corpus.jsonl")
    first = data.prepare([corpus], work / "ds", work / "tok", show_progress=False)
    prepared = data.prepare([corpus], work / "ds2", work / "tok", show_progress=False)
    documents = list(data.read_documents(corpus))
    tokenizer = AutoTokenizer.from_pretrained(work / "tok")
    start = time.perf_counter()
    tokens = sum(len(ids) for ids in tokenizer(documents, add_special_tokens=False).input_ids)
    return first["tokens_per_s"], prepared["tokens_per_s"], tokens / (time.perf_counter() - start)


def main() -> None:
    from pai_cookbook.core.checkpoints import families
    from pai_cookbook.core.configs.config import DataConfig, OptimizerConfig, RunConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="cookbook / transformers pairs, run in turns")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU mode (module doc); --seq and --batch are its own there")
    opts = parser.parse_args()
    if opts.device == "cuda":
        on_gpu(opts)
        return
    model = families.from_hf(families.tiny_hf_config("llama", **BENCH_MODEL))
    config = RunConfig(model=model, data=DataConfig(seq_length=opts.seq, micro_batch_size=opts.batch,
                                                    global_batch_size=opts.batch),
                       optimizer=OptimizerConfig(lr=1e-4, min_lr=1e-5), train_iters=opts.steps)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(opts.repeats):
            order = ["cookbook", "transformers"] if i % 2 == 0 else ["transformers", "cookbook"]
            figures = {name: cookbook(config, opts.steps, work / f"pair{i}") if name == "cookbook"
                       else hugging_face(config, opts.steps) for name in order}
            pairs.append(figures)
            print(f"  pair {i + 1}: cookbook worker {figures['cookbook']:,.0f} tokens/s, transformers + PyTorch "
                  f"{figures['transformers']:,.0f}: {figures['cookbook'] / figures['transformers']:.3f}x", flush=True)
        unfused = dataclasses.replace(config, model=dataclasses.replace(model, attention_backend="unfused"))
        others = {"cookbook worker, unfused attention": cookbook(unfused, opts.steps, work / "unfused"),
                  "raw Megatron-Core loop": raw_megatron(config, opts.steps, work)}
        first_rate, prepare_rate, tokenizer_rate = preprocessing(work)
    print(f"model: {model.num_layers} layers x {model.hidden_size}, vocab {model.vocab_size}; batch {opts.batch} x "
          f"seq {opts.seq}, fp32, {opts.steps} steps (median after 2 warm-up), {os.cpu_count()} CPU threads")
    figures = {"cookbook worker": statistics.median(p["cookbook"] for p in pairs)} | others | {
        "HF LlamaForCausalLM + PyTorch loop": statistics.median(p["transformers"] for p in pairs)}
    for name, tokens_per_s in figures.items():
        print(f"  {name:36s} {tokens_per_s:10,.0f} tokens/s")
    ratio = figures["cookbook worker"] / figures["raw Megatron-Core loop"]
    print(f"  cookbook / raw Megatron-Core: {ratio:.3f} (overhead {100 * (1 - ratio):+.1f}%)")
    print(f"  data.prepare {prepare_rate:,.0f} tokens/s vs tokenizer batch call {tokenizer_rate:,.0f} tokens/s "
          f"(ratio {prepare_rate / tokenizer_rate:.2f}); its first call in a process {first_rate:,.0f} tokens/s "
          f"(Megatron-Core's import included)")
    ratios = sorted(p["cookbook"] / p["transformers"] for p in pairs)
    print(f"cookbook / transformers + PyTorch: {statistics.median(ratios):.2f}x "
          f"(median of {len(pairs)} pairs run in turns; {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
