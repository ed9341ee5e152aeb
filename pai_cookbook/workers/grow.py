"""The vocabulary-growth worker: a checkpoint's embedding and output layer, grown to a larger vocabulary.

Its job is a `core.launching.jobs.GrowJob`. The checkpoint is loaded into a model built with the larger
vocabulary (Megatron-Core loads the stored rows and leaves the others zero: the embedding's and output
layer's sharded tensors allow a shape mismatch), the new rows are initialised from the old ones, the
padding rows are zeroed, and the result is saved as a new checkpoint with the new tokenizer. One
process holds the whole model (about 4 bytes per parameter in fp32).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import ParallelConfig, PrecisionConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import GrowJob
from pai_cookbook.workers.models import build_model


def new_rows(old: torch.Tensor, sources: list[list[int]], init: str, std: float,
             generator: torch.Generator) -> torch.Tensor:
    """Rows for new tokens from the old rows `old` [old vocab, hidden] (see `extend.INITS`)."""
    if init == "mean":
        return torch.stack([old[ids].float().mean(0) for ids in sources]).to(old.dtype)
    if init == "hf_mean":  # transformers' resize_token_embeddings(mean_resizing=True)
        weight = old.float()
        mean = weight.mean(0)
        centered = weight - mean
        covariance = centered.T @ centered / weight.shape[0]
        # N(mean, 1e-9 x covariance), as transformers samples it (its epsilon).
        factor = torch.linalg.cholesky(1e-9 * covariance + 1e-30 * torch.eye(len(mean)))
        noise = torch.randn(len(sources), len(mean), generator=generator) @ factor.T
        return (mean + noise).to(old.dtype)
    if init == "random":
        return (torch.randn(len(sources), old.shape[1], generator=generator) * std).to(old.dtype)
    raise ValueError(f"unknown init {init!r}")


def grow(job: GrowJob, device) -> dict[str, Any]:
    old_model, dtype = checkpoint.read_config(job.src)
    model = replace(old_model, vocab_size=job.vocab_size)
    (gpt,) = build_model(model, ParallelConfig(), PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype]), device, 0)
    checkpoint.load([gpt], job.src)
    generator = torch.Generator().manual_seed(job.seed)
    old_vocab, new_vocab = old_model.vocab_size, model.vocab_size
    layers = [gpt.embedding.word_embeddings.weight]
    if not model.tie_word_embeddings:
        layers.append(gpt.output_layer.weight)
    with torch.no_grad():
        for weight in layers:
            weight[new_vocab:] = 0  # padding rows: never a token, kept out of the softmax by the model
            weight[old_vocab:new_vocab] = new_rows(weight[:old_vocab], job.sources, job.init,
                                                   model.init_method_std, generator)
    checkpoint.save([gpt], job.dst, model, dtype, assets=Path(job.assets), grown_from=job.src, init=job.init)
    return {"old_vocab": old_vocab, "vocab": new_vocab, "padded_rows": model.padded_vocab_size(1),
            "init": job.init}


@worker.entry(GrowJob)
def main(job: GrowJob) -> dict[str, Any]:
    with worker.session(ParallelConfig(), seed=0) as device:
        return grow(job, device)


if __name__ == "__main__":
    main()
