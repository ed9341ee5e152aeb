"""PAI Megatron Cookbook helper package: `core/` (the engine), the recipes, `workers/` (what torchrun runs)."""

import logging
import sys
import warnings

from pai_cookbook.core.machine import versions

try:
    versions.check()  # a Megatron-Core or torch outside the tested range is refused here, naming the range and the fix
except RuntimeError as _refused:
    if sys.argv[:1] == ["-m"]:  # `python -m pai_cookbook.<command>`: said as its bad input is, not as a traceback
        print(f"error: {_refused}", file=sys.stderr)
        raise SystemExit(2) from None
    raise

# Megatron-Core warns at import, once per module, that Transformer Engine and Apex are missing. The
# environment report (`runtime.environment_report`, notebook 00) says which layers run here, once; in a
# notebook cell these repeated lines say nothing more. The launcher filters them in its workers likewise.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
    warnings.filterwarnings("ignore", message=_message)
# Megatron-Core 0.19's torch_dist load calls torch's loader with no_dist=True inside an initialized group, and torch
# warns on every load that it assumes one process; its twin on saving is kept (no cookbook save asks for it).
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
                                          r"intent is to load in a single process")


class _Unsaid(logging.Filter):
    """Log lines that say nothing in a notebook cell: torch's "No CUDA runtime is found, using CUDA_HOME=..." (its
    C++-extension module, which Megatron-Core imports, on every machine without CUDA); Megatron-Core 0.19's "GPTModel IS
    DEPRECATED" (the cookbook builds GPTModel on purpose: it is the model every supported release has) and its DDP's
    request that callers pre-compute the distributed optimizer's parameter layout, which it then computes itself as
    0.16 did (the cookbook builds DDP as every supported release takes it). And 0.19's checkpoint notices: "load_common
    is deprecated" on every load of a checkpoint with a `common.pt`, which the cookbook's saves write on purpose so that
    0.16 reads them (`core.checkpoints.checkpoint_format`), and "MCore's async save is deprecated", which 0.19's own
    synchronous save prints (it saves through the asynchronous path)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("No CUDA runtime is found", "GPTModel IS DEPRECATED",
                                                   "DistributedDataParallel: full_param_layout not provided",
                                                   "load_common is deprecated", "MCore's async save is deprecated"))


for _logger in ("torch.utils.cpp_extension", "megatron.core.models.gpt.gpt_model",
                "megatron.core.distributed.distributed_data_parallel",
                "megatron.core.dist_checkpointing.strategies.common", "megatron.core.dist_checkpointing.strategies.torch"):
    logging.getLogger(_logger).addFilter(_Unsaid())
