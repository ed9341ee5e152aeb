"""Benchmark generation: Megatron-Core's static engine with the KV cache vs without it (the prefix
recomputed every step) vs Hugging Face `generate`, on the same weights, prompts and new-token count.

    python scripts/benchmark_generate.py [--new-tokens 128] [--batch 4] [--tp 1]

With the cache, N new tokens cost one prefill plus N-1 forward steps of one token; without it, step i
re-reads the whole prefix (prompt + i tokens), so the cost grows as N^2. The script prints tokens/s of
generation only (model loading excluded) and the tokens per forward step that show the difference.
Not a test: on a 2-core VM the noise (about +-15%) is larger than small differences, so it prints
figures rather than asserting on them (tests/test_generate.py asserts the one-token steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

# A 4-layer Llama-style model, 256 wide, GQA 8/4 heads, the tiny 256-token vocabulary: about 3M
# parameters, big enough that attention over a growing prefix shows in the uncached timing.
BENCH_MODEL = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
               "num_key_value_heads": 4, "max_position_embeddings": 512}
PROMPT = "The Python language reference describes the syntax and the core semantics of the language"


def hf_batched(hf_dir: Path, prompt_ids: list[list[int]], new_tokens: int) -> float:
    """tokens/s of Hugging Face `generate` on the whole batch at once (left padding + attention mask)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
    return len(prompt_ids) * new_tokens / (time.perf_counter() - start)


def main() -> None:
    from pai_cookbook import convert, generate, hf_baseline
    from pai_cookbook.core.config import ParallelConfig
    from pai_cookbook.generate import GenerationConfig
    from pai_cookbook.tiny_models import make_tiny_hf_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="prompts, decoded as one batch")
    parser.add_argument("--tp", type=int, default=1)
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    hf = make_tiny_hf_model("llama", work / "hf", **BENCH_MODEL)
    convert.hf_to_megatron(hf, work / "mcore")
    # Prompts of slightly different lengths: the batch is right-padded, as in real use.
    records = [{"prompt": " ".join(PROMPT.split()[:8 + i]), "line": i + 1} for i in range(opts.batch)]
    cached = GenerationConfig(max_new_tokens=opts.new_tokens, ignore_eos=True, repetition_penalty=1.0,
                              batch_size=opts.batch)
    uncached = dataclasses.replace(cached, kv_cache=False)
    parallel = ParallelConfig(tensor_model_parallel_size=opts.tp)
    jobs = [generate.prepare(work / "mcore", records, c, parallel, label) for c, label in
            ((cached, "cached"), (uncached, "uncached"))]
    results = generate.run_jobs(jobs, run_dir=work / "run", show_progress=False)
    reference = hf_baseline.hf_generate(hf, jobs[0].prompt_ids, cached)
    batched = hf_batched(hf, jobs[0].prompt_ids, opts.new_tokens)

    print(f"\n{opts.batch} prompts x {opts.new_tokens} new tokens, fp32, TP={opts.tp}, {torch.get_num_threads()} "
          f"threads in this process")
    print(f"{'engine':<44}{'tokens/s':>10}{'forward steps':>15}{'tokens/step (first, rest)':>28}")
    for label, result in zip(("Megatron-Core static engine, KV cache", "Megatron-Core static engine, no cache"),
                             results):
        lengths = result["forward_lengths"][0]
        print(f"{label:<44}{result['tokens_per_s']:>10.1f}{len(lengths):>15}"
              f"{f'{lengths[0]}, {lengths[1]}..{lengths[-1]}':>28}")
    print(f"{'Hugging Face generate, one prompt at a time':<44}{reference['tokens_per_s']:>10.1f}")
    print(f"{'Hugging Face generate, batch (left padding)':<44}{batched:>10.1f}")
    same = results[0]["tokens"] == results[1]["tokens"] == reference["tokens"]
    print(f"cached / uncached speed-up: {results[0]['tokens_per_s'] / results[1]['tokens_per_s']:.2f}x; "
          f"greedy tokens identical (cached, uncached, HF one at a time): {same}")


if __name__ == "__main__":
    main()
