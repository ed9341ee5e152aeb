"""Checkpoints in both formats: the cookbook's distributed checkpoints (atomic, self-describing, damage found), Hugging
Face folders, and the family readers and tensor mapping between them."""
