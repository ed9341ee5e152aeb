"""The upcycling worker: a dense checkpoint's MLPs copied into every expert of an MoE model, with
Megatron-Core's own `upcycle_state_dict` (its job is a `core.launching.jobs.UpcycleJob`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.configs.config import PrecisionConfig
from pai_cookbook.core.launching import worker
from pai_cookbook.core.launching.jobs import UpcycleJob
from pai_cookbook.workers.models import build_model


@worker.entry(UpcycleJob)
def main(job: UpcycleJob) -> dict[str, Any]:
    from megatron.core.transformer.moe.upcycling_utils import upcycle_state_dict

    src, out, moe, parallel = Path(job.src), job.out, job.model, job.parallel
    with worker.session(parallel, job.seed) as device:
        dense, dtype = checkpoint.read_config(src)
        precision = PrecisionConfig(dtype=checkpoint.DTYPE_NAMES[dtype])
        dense_chunks = build_model(dense, parallel, precision, device, job.seed)
        checkpoint.load(dense_chunks, src)
        moe_chunks = build_model(moe, parallel, precision, device, job.seed)
        for dense_chunk, moe_chunk in zip(dense_chunks, moe_chunks):
            state = upcycle_state_dict([moe_chunk], [dense_chunk])["model"]
            # Megatron-Core expands every layer's dense MLP; layers that stay dense (moe_layer_freq > 1)
            # keep theirs under the original names, so only the MoE model's own keys are loaded.
            wanted = moe_chunk.state_dict().keys()
            moe_chunk.load_state_dict({k: v for k, v in state.items() if k in wanted}, strict=True)
        checkpoint.save(moe_chunks, out, moe, dtype, assets=Path(src) / checkpoint.HF_ASSETS,
                        upcycled_from=str(src))
        return {"checkpoint": out}


if __name__ == "__main__":
    main()
