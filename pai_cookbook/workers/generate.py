"""The generation worker: every rank builds the model at the job's layout, loads the checkpoint (Megatron-Core reshards
it) and generates its share of the batches through `workers.engine` (Megatron-Core's static inference engine); the
results are gathered on global rank 0.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import PrecisionConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import GenerationBatch, GenerationJob
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.text.tokenizer import MegatronView
from pai_cookbook.workers.engine import BATCH_SEED_STRIDE, build_engine, decoding_weights, engine_record, generate_batch


def run_job(job: GenerationJob, device: runtime.DeviceInfo) -> dict[str, Any]:
    """Generate every prompt of one job on this rank's share of the batches; results on global rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.sampling_params import SamplingParams

    from pai_cookbook.core.modeling.model import torch_dtype
    from pai_cookbook.workers.models import build_model

    config, parallel = job.config, job.parallel
    model, saved_dtype = checkpoint.read_config(job.ckpt)
    precision = PrecisionConfig(dtype=config.dtype or checkpoint.DTYPE_NAMES[saved_dtype])
    (gpt,) = build_model(model, parallel, precision, device, seed=0, initialize=False)
    checkpoint.load([gpt], job.ckpt)
    tokenizer = MegatronView(checkpoint.load_tokenizer(job.ckpt), job.eos_ids)
    prompts = job.prompt_ids
    engine = build_engine(gpt, model, tokenizer, config, job.max_sequence, parallel, torch_dtype(precision), device)
    controller, wrapped = engine.controller, engine.controller.inference_wrapped_model
    params = SamplingParams(temperature=config.temperature, top_k=config.top_k, top_p=float(config.top_p),
                            num_tokens_to_generate=config.max_new_tokens)
    params.add_attributes({"no_early_termination": True})  # end-of-sequence is the cookbook controller's rule

    batch_size = config.batch_size
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    # Data-parallel replicas share the batches. Not with EP > 1: every forward then exchanges tokens
    # with the other EP ranks, so all ranks must run the same batches step for step.
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if parallel.expert_model_parallel_size > 1:
        dp_rank, dp_size = 0, 1
    mine: dict[int, tuple[list[int], str]] = {}
    kv_bytes = 0
    forward_lengths: list[tuple[int, list[int]]] = []
    wrapped.forward_seconds = 0.0
    packing = time.perf_counter()
    # On the CPU path the linears run oneDNN's inner product on weights packed once for the whole job, like loading
    # them (cpu.linear.packed_for_decoding); its seconds are reported apart from the generation's.
    with decoding_weights(engine, rows=batch_size):
        start = time.perf_counter()
        for number, batch in enumerate(batches):
            if number % dp_size != dp_rank:
                continue
            controller.sampling_rng.manual_seed(config.seed * BATCH_SEED_STRIDE + number)
            wrapped.forward_lengths = []
            done = generate_batch(engine, [prompts[i] for i in batch], params, vocab_size=model.vocab_size,
                                  repetition_penalty=config.repetition_penalty,
                                  eos_ids=[] if config.ignore_eos else job.eos_ids, stop=config.stop,
                                  max_new_tokens=config.max_new_tokens)
            kv_bytes = max(kv_bytes, _kv_cache_bytes(wrapped))
            for row, (i, request) in enumerate(zip(batch, done)):
                mine[i] = (request.generated_tokens.tolist(), controller.finish[row])
            forward_lengths.append((number, wrapped.forward_lengths))
            if worker.rank() == 0:
                worker.progress(min((number + 1) * batch_size, len(prompts)), len(prompts))
        seconds = time.perf_counter() - start
    result = _gather(job, mine, forward_lengths, (seconds, wrapped.forward_seconds, start - packing), parallel, kv_bytes)
    return result and result | {"engine": engine_record(engine)}


def _kv_cache_bytes(wrapped) -> int:
    """The bytes of the KV cache Megatron-Core's static context holds on this rank (every layer's key and value)."""
    return sum(t.nbytes for pair in wrapped.inference_context.key_value_memory_dict.values() for t in pair)


def _gather(job, mine, forward_lengths, timing: tuple[float, float, float], parallel, kv_bytes: int) -> dict[str, Any]:
    """Collect every rank's outputs on rank 0; check that the ranks of each model replica agree."""
    from megatron.core import parallel_state as ps

    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, {"dp": ps.get_data_parallel_rank(), "outputs": mine,
                                                   "seconds": timing, "forward_lengths": forward_lengths,
                                                   "kv_bytes": kv_bytes})
    if worker.rank() != 0:
        return {}
    merged: dict[int, tuple[list[int], str]] = {}
    agree = True
    for share in everyone:  # the TP/PP ranks of one DP replica must hold identical outputs
        for i, out in share["outputs"].items():
            agree &= merged.setdefault(i, out) == out
    tokens = [merged[i][0] for i in range(len(job.prompt_ids))]
    slowest, forward, _ = max(share["seconds"] for share in everyone)  # the slowest rank's total and forward time
    packing = max(share["seconds"][2] for share in everyone)
    generated = sum(len(t) for t in tokens)
    return {"label": job.label, "tokens": tokens, "finish": [merged[i][1] for i in range(len(tokens))],
            "ranks_agree": agree, "seconds": slowest, "forward_seconds": forward, "packing_seconds": packing,
            "generated_tokens": generated,
            "kv_cache_bytes": max(share["kv_bytes"] for share in everyone),  # the most any rank held
            "tokens_per_s": generated / slowest if slowest > 0 else 0.0,
            "forward_lengths": [lengths for _, lengths in sorted(  # per batch, from whichever rank ran it
                {number: lengths for share in everyone for number, lengths in share["forward_lengths"]}.items())],
            "layout": {"tp": parallel.tensor_model_parallel_size, "pp": parallel.pipeline_model_parallel_size,
                       "ep": parallel.expert_model_parallel_size, "dp": ps.get_data_parallel_world_size()}}


@worker.entry(GenerationBatch)
def main(batch: GenerationBatch) -> dict[str, Any] | None:
    with worker.session() as planned:
        layouts = ((job.parallel, job.config.seed) for job in batch.jobs)
        devices = runtime.each_layout(layouts, planned.layers)
        results = [run_job(job, device) for job, device in zip(batch.jobs, devices)]
    return {"jobs": results} if worker.rank() == 0 else None


if __name__ == "__main__":
    main()
