"""The two sides of a torchrun launch and what travels between them: typed jobs as JSON, the folder lock, the
processes a launch owns, multi-node host steps, which rank failed, progress, how commands end, what users hand in."""
