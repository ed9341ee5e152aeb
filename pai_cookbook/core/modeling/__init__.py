"""Megatron-Core GPT models from the cookbook's configs: the model, its layer spec and the swaps in it, emulated FP8."""
