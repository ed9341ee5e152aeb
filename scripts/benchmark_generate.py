"""Benchmark generation: Megatron-Core's static engine (KV cache, and for the tiny model without it) vs
Hugging Face `generate` batched with left padding, on the same weights, prompts and new-token count.

    python scripts/benchmark_generate.py [--model tiny|smollm2] [--new-tokens N] [--batch B] [--runs 3] [--tp 1]
    python scripts/benchmark_generate.py --device cuda     # a GPU (ci/gpu.sh runs it)

`tiny`: a 4-layer x 256 Llama-style model (~3M parameters, 256-token vocabulary), 4 prompts x 128 tokens.
`smollm2`: the real SmolLM2-135M-Instruct (`pai_cookbook.fixtures.smollm2`), 8 prompts x 64 tokens.
tokens/s count generation only (model loading excluded), median of `--runs`; each cookbook run is followed by
a `generate` run and the ratio is the median of those pairs' ratios. Each engine row splits a decode step
into the model's forward and everything else (sampling, the controller's bookkeeping). With
the cache, N new tokens cost one prefill plus N-1 forward steps of one token; without it step i re-reads
the whole prefix. "packing s": the seconds before the first step in which the worker packs the weights for oneDNN
on a CPU (`cpu.linear.packed_for_decoding`), once per job like loading them, so not in tokens/s (`generate`'s
loading is not either). The last line is the cookbook's ratio to batched `generate`.
Not a test: on a 2-core VM the noise (about +-15%) is larger than small differences.

`--device cuda`: Llama-3.2-1B's shape (random weights), bf16, 8 prompts of 8-40 tokens x 128 new tokens, the cookbook
(its layers as `core.machine.build.choose_layers` decides there) against batched `generate` eager and compiled (a static cache,
whose decode step `generate` compiles itself on CUDA); the ratios come last.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

# A 4-layer Llama-style model, 256 wide, GQA 8/4 heads, the tiny 256-token vocabulary: about 3M
# parameters, big enough that attention over a growing prefix shows in the uncached timing.
BENCH_MODEL = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
               "num_key_value_heads": 4, "max_position_embeddings": 512}
PROMPT = "The Python language reference describes the syntax and the core semantics of the language"


def left_padded(prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of the prompts left-padded (with id 0) to the longest, as `generate` takes a batch."""
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    return ids, mask


def hf_batched(model, prompt_ids: list[list[int]], new_tokens: int, **settings) -> tuple[float, list]:
    """Tokens/s of one Hugging Face `generate` over the whole batch at once (left padding + attention mask), and
    its greedy tokens."""
    ids, mask = (t.to(model.device) for t in left_padded(prompt_ids))
    width = ids.shape[1]
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **settings)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return len(prompt_ids) * new_tokens / (time.perf_counter() - start), out[:, width:].tolist()


def on_gpu(opts) -> None:
    """The GPU mode (module doc)."""
    from benchmark_train import GPU_MODEL
    from transformers import AutoModelForCausalLM

    from pai_cookbook import convert, generate
    from pai_cookbook.core.machine import runtime
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model
    from pai_cookbook.generate import GenerationConfig

    batch, new_tokens = opts.batch or 8, opts.new_tokens or 128
    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    hf = make_tiny_hf_model("llama", work / "hf", **GPU_MODEL)
    convert.hf_to_megatron(hf, work / "mcore")
    words = (PROMPT + " ") * 4
    records = [{"prompt": " ".join(words.split()[:6 + 4 * i]), "line": i + 1} for i in range(batch)]
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, repetition_penalty=1.0, batch_size=batch,
                              dtype="bf16")
    job = generate.prepare(work / "mcore", records, config, None, "gpu")
    ours = [generate.run_jobs([job], run_dir=work / f"run-{i}", show_progress=False)[0] for i in range(opts.runs)]
    peer = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).to("cuda")
    hf_batched(peer, job.prompt_ids, 8)  # warm-up
    eager = [hf_batched(peer, job.prompt_ids, new_tokens) for _ in range(opts.runs)]
    # transformers' own compiled path: with a static cache on CUDA, `generate` compiles its decode step itself
    # (CompileConfig's "reduce-overhead", CUDA graphs). Compiling `peer.forward` by hand as well made the prefill
    # and the decode steps share one CUDA-graph tree, and the second call read outputs the first had overwritten
    # (an H100, 2026-11-26).
    compiled = [hf_batched(peer, job.prompt_ids, new_tokens, cache_implementation="static")
                for _ in range(opts.runs + 1)][1:]  # the first call compiles
    rate = {name: statistics.median(r[0] for r in runs) for name, runs in (("eager", eager), ("compiled", compiled))}
    mine = statistics.median(r["tokens_per_s"] for r in ours)
    lengths = [len(p) for p in job.prompt_ids]
    print(f"{runtime.detect_device().name}, layers {ours[0]['layers']['layers']}: Llama-3.2-1B shape, bf16, {batch} "
          f"prompts of {min(lengths)}-{max(lengths)} tokens x {new_tokens} new tokens, median of {opts.runs} runs")
    print(f"  cookbook static engine, KV cache  {mine:10.1f} tokens/s")
    print(f"  transformers generate, eager      {rate['eager']:10.1f} tokens/s")
    print(f"  transformers generate, compiled   {rate['compiled']:10.1f} tokens/s")
    print(f"greedy tokens identical to eager generate: {ours[0]['tokens'] == eager[0][1]}")
    print(f"cookbook / transformers eager: {mine / rate['eager']:.2f}x; "
          f"cookbook / transformers compiled: {mine / rate['compiled']:.2f}x")


def main() -> None:
    from transformers import AutoModelForCausalLM

    from pai_cookbook import convert, generate
    from pai_cookbook.core.configs.config import ParallelConfig
    from pai_cookbook.fixtures import smollm2
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model
    from pai_cookbook.generate import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--batch", type=int, help="prompts, decoded as one batch")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU mode (module doc)")
    opts = parser.parse_args()
    if opts.device == "cuda":
        on_gpu(opts)
        return
    real = opts.model == "smollm2"
    batch, new_tokens = opts.batch or (8 if real else 4), opts.new_tokens or (64 if real else 128)
    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    hf = smollm2.hf_folder() if real else make_tiny_hf_model("llama", work / "hf", **BENCH_MODEL)
    convert.hf_to_megatron(hf, work / "mcore")
    # Prompts of slightly different lengths: the batch is left-padded, as in real use.
    records = [{"prompt": " ".join(PROMPT.split()[:8 + i]), "line": i + 1} for i in range(batch)]
    cached = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, repetition_penalty=1.0, batch_size=batch)
    parallel = ParallelConfig(tensor_model_parallel_size=opts.tp)
    peer = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    # The machine's speed drifts over a minute (other tenants): each cookbook run is followed by a `generate` run,
    # and the ratio is the median of those pairs' ratios.
    results, batched_rates, hf_tokens = [], [], None
    for run in range(opts.runs):
        job = generate.prepare(work / "mcore", records, cached, parallel, f"cached-{run}")
        results += generate.run_jobs([job], run_dir=work / f"run-{run}", show_progress=False)
        rate, hf_tokens = hf_batched(peer, job.prompt_ids, new_tokens)
        batched_rates.append(rate)
    if not real:  # the O(N^2) baseline, once
        job = generate.prepare(work / "mcore", records, dataclasses.replace(cached, kv_cache=False), parallel,
                               "uncached")
        results += generate.run_jobs([job], run_dir=work / "run-uncached", show_progress=False)
    batched = statistics.median(batched_rates)

    print(f"\n{opts.model}: {batch} prompts x {new_tokens} new tokens, fp32, TP={opts.tp}, "
          f"{torch.get_num_threads()} threads in this process, median of {opts.runs} runs")
    print(f"{'engine':<40}{'tokens/s':>10}{'steps':>7}{'ms/step: forward':>18}{'other':>8}{'packing s':>11}")
    rows = {"Megatron-Core static engine, KV cache": results[:opts.runs],
            "Megatron-Core static engine, no cache": results[opts.runs:]}
    for label, runs in rows.items():
        if not runs:
            continue
        mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        steps = sum(map(len, mid["forward_lengths"]))
        forward_ms = 1000 * mid["forward_seconds"] / steps
        other_ms = 1000 * (mid["seconds"] - mid["forward_seconds"]) / steps
        print(f"{label:<40}{mid['tokens_per_s']:>10.1f}{steps:>7}{forward_ms:>18.2f}{other_ms:>8.2f}"
              f"{mid['packing_seconds']:>11.2f}")
    print(f"{'Hugging Face generate, batched':<40}{batched:>10.1f}")
    same = all(r["tokens"] == hf_tokens for r in results)
    print(f"greedy tokens identical to batched generate (every run): {same}")
    pairs = [r["tokens_per_s"] / rate for r, rate in zip(results, batched_rates)]
    print(f"cookbook / transformers batched generate, run by run: {', '.join(f'{p:.2f}' for p in pairs)}")
    print(f"cookbook / transformers batched generate: {statistics.median(pairs):.2f}x")


if __name__ == "__main__":
    main()
