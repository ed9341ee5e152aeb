"""PAI Megatron Cookbook helper package: `core/` (the engine), the recipes, `workers/` (what torchrun runs)."""

import warnings

from pai_cookbook.core import versions

versions.check()  # a Megatron-Core or torch outside the tested range is refused here, naming the range and the fix

# Megatron-Core warns at import, once per module, that Transformer Engine and Apex are missing. The
# environment report (`runtime.environment_report`, notebook 00) says which layers run here, once; in a
# notebook cell these repeated lines say nothing more. The launcher filters them in its workers likewise.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
    warnings.filterwarnings("ignore", message=_message)
