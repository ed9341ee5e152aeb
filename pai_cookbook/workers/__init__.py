"""What torchrun runs: one module per recipe, each started the same way (`core.launching.worker.entry`).

Nothing here is imported by the notebook process; the recipes (`pai_cookbook.train`, `.convert`, ...)
validate a job there, and `core.launching.launch` hands it to one of these modules as JSON.
"""
