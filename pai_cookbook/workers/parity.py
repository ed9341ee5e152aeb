"""The parity worker: the checkpoint's logits at each layout of a `core.launching.jobs.ParityJob`,
compared on rank 0 with the Hugging Face model's on the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import ParityJob
from pai_cookbook.core.machine import runtime
from pai_cookbook.core.measures.logit_parity import compare_logits, hf_logits, token_batch
from pai_cookbook.core.modeling.model import torch_dtype
from pai_cookbook.workers import forward
from pai_cookbook.workers.models import build_model


def megatron_logits(chunks: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, padded vocab] on global rank 0 (None elsewhere), any layout."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return forward.last_stage(chunks, tokens,
                              lambda output: gather_from_tensor_model_parallel_region(output).float().cpu())


def _save_logits(logits: torch.Tensor, folder: Path, index: int) -> str:
    """Write one layout's logits (fp32, the real vocabulary) to `folder/layout<index>.safetensors`, atomically."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"layout{index}.safetensors"
    partial = path.with_suffix(".partial")
    save_file({"logits": logits.float().contiguous()}, str(partial))
    partial.replace(path)
    return str(path)


@worker.entry(ParityJob)
def main(job: ParityJob) -> dict[str, Any] | None:
    model, _ = checkpoint.read_config(job.ckpt)
    tokens = token_batch(Path(job.ckpt) / checkpoint.HF_ASSETS, job.batch, job.seq)
    reference = hf_logits(job.hf_dir, tokens) if worker.rank() == 0 else None
    dtype = torch_dtype(job.precision)
    own_error, rows = {}, []
    with worker.session() as planned:
        if reference is not None and dtype != torch.float32:
            # transformers' own error in this dtype (on this machine's device): the yardstick for Megatron-Core's
            hf_low = hf_logits(job.hf_dir, tokens, dtype, "cuda" if planned.is_cuda else "cpu")
            own_error = {"hf_low_precision_max_abs_diff": float((hf_low - reference).abs().max())}
        devices = runtime.each_layout(((p, job.seed) for p in job.layouts), planned.layers)
        for i, (parallel, device) in enumerate(zip(job.layouts, devices)):
            chunks = build_model(model, parallel, job.precision, device, job.seed)
            checkpoint.load(chunks, job.ckpt)
            for chunk in chunks:
                chunk.eval()
            logits = megatron_logits(chunks, tokens)
            if reference is not None:
                rows.append(compare_logits(reference, logits[..., :model.vocab_size], tokens) | own_error)
                if job.logits_dir:
                    rows[-1]["logits_file"] = _save_logits(logits[..., :model.vocab_size], Path(job.logits_dir), i)
    return {"rows": rows} if worker.rank() == 0 else None


if __name__ == "__main__":
    main()
