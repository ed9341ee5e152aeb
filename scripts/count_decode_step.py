"""Count what one decode step does: ATen ops and Python calls, the cookbook's engine against transformers' `generate`.

    python scripts/count_decode_step.py [--model tiny|smollm2]

Timings on a shared 2-core machine drift by 10-30% within minutes; these counts do not, so a change to the decode
path shows here exactly. Both sides decode the benchmark's left-padded prompts greedily (`benchmark_generate.py`),
once with 4 and once with 12 new tokens; a step's count is the difference divided by 8, so loading, the prefill and
the per-call set-up cancel. The cookbook's engine is built as the generation worker builds it
(`workers.generate.build_engine`, `generate_batch`, the weights packed for oneDNN), in this process
(`runtime.world_of_one`). The last line is the cookbook's Python calls per step over transformers'.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("TQDM_DISABLE", "1")  # the static engine's own bar, one per generate call
SHORT, LONG = 4, 12  # new tokens of the two runs whose difference is 8 decode steps


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count(run: Callable[[], object]) -> tuple[collections.Counter, int]:
    """ATen ops by name and Python calls (functions and builtins) of one `run()`, after a warm-up call."""
    run()
    with _OpCounter() as counter:
        run()
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counter.ops, calls


def per_step(short: tuple[collections.Counter, int], long: tuple[collections.Counter, int]
             ) -> tuple[dict[str, float], float]:
    ops = collections.Counter(long[0])
    ops.subtract(short[0])
    steps = LONG - SHORT
    return {name: n / steps for name, n in ops.items() if n}, (long[1] - short[1]) / steps


def main() -> None:
    from benchmark_generate import BENCH_MODEL, PROMPT, left_padded
    from megatron.core.inference.sampling_params import SamplingParams
    from transformers import AutoModelForCausalLM

    from pai_cookbook import convert, generate
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.core.configs.config import ParallelConfig, PrecisionConfig
    from pai_cookbook.core.machine import runtime
    from pai_cookbook.core.text.tokenizer import MegatronView
    from pai_cookbook.fixtures import smollm2
    from pai_cookbook.fixtures.tiny_models import make_tiny_hf_model
    from pai_cookbook.generate import GenerationConfig
    from pai_cookbook.workers.engine import build_engine, decoding_weights, generate_batch
    from pai_cookbook.workers.models import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--top", type=int, default=12, help="ATen ops to list, by count")
    opts = parser.parse_args()
    real = opts.model == "smollm2"
    rows = 8 if real else 4
    work = Path(tempfile.mkdtemp(prefix="count_decode_"))
    hf = smollm2.hf_folder() if real else make_tiny_hf_model("llama", work / "hf", **BENCH_MODEL)
    convert.hf_to_megatron(hf, work / "mcore")
    records = [{"prompt": " ".join(PROMPT.split()[:8 + i]), "line": i + 1} for i in range(rows)]
    config = GenerationConfig(max_new_tokens=LONG, ignore_eos=True, repetition_penalty=1.0, batch_size=rows)
    job = generate.prepare(work / "mcore", records, config, ParallelConfig(), "count")
    prompts = job.prompt_ids

    with runtime.world_of_one() as device:
        model, _ = checkpoint.read_config(job.ckpt)
        (gpt,) = build_model(model, ParallelConfig(), PrecisionConfig(dtype="fp32"), device, seed=0, initialize=False)
        checkpoint.load([gpt], job.ckpt)
        tokenizer = MegatronView(checkpoint.load_tokenizer(job.ckpt), job.eos_ids)
        engine = build_engine(gpt, model, tokenizer, config, job.max_sequence, ParallelConfig(), torch.float32,
                              device)

        def cookbook(new_tokens: int) -> Callable[[], object]:
            params = SamplingParams(top_k=1, num_tokens_to_generate=new_tokens)
            params.add_attributes({"no_early_termination": True})
            return lambda: generate_batch(engine, prompts, params, vocab_size=model.vocab_size, repetition_penalty=1.0,
                                          eos_ids=[], stop=[], max_new_tokens=new_tokens)

        with decoding_weights(engine, rows):  # as the worker runs a job (on the CPU path: cpu.linear)
            ours = per_step(count(cookbook(SHORT)), count(cookbook(LONG)))

    peer = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids, mask = left_padded(prompts)

    def transformers(new_tokens: int) -> Callable[[], object]:
        def run():
            with torch.no_grad():
                return peer.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=0)
        return run

    theirs = per_step(count(transformers(SHORT)), count(transformers(LONG)))

    print(f"\n{opts.model}: {rows} left-padded prompts, one decode step (the difference of {LONG} and {SHORT} new "
          f"tokens, / {LONG - SHORT})")
    print(f"{'':<28}{'ATen ops':>10}{'Python calls':>14}")
    for label, (ops, calls) in (("cookbook engine", ours), ("transformers generate", theirs)):
        print(f"{label:<28}{sum(ops.values()):>10.0f}{calls:>14.0f}")
    names = sorted(set(ours[0]) | set(theirs[0]), key=lambda n: -(ours[0].get(n, 0) + theirs[0].get(n, 0)))
    print(f"\n{'ATen op':<48}{'cookbook':>9}{'transformers':>13}")
    for name in names[:opts.top]:
        print(f"{name:<48}{ours[0].get(name, 0):>9.0f}{theirs[0].get(name, 0):>13.0f}")
    print(f"cookbook / transformers Python calls per decode step: {ours[1] / theirs[1]:.2f}x")


if __name__ == "__main__":
    main()
