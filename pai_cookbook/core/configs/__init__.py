"""Validated configuration dataclasses (the training run, the model, generation, RLHF) and the parallel layouts
that fit a model and a world."""
