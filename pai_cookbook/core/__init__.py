"""The engine every step of the cookbook shares, in the notebook process and in the torchrun workers, in rooms
by purpose:

- `machine`: where a run runs and what it builds there: the device and the launch environment (`runtime`), the one
  build plan (`build`), Megatron-Core on a CPU (`compat`, `standins`, `megatron_import`), the supported releases
  (`versions`), the device guard CI runs under.
- `launching`: the two sides of a torchrun launch (`launch`, `worker`), typed jobs as JSON (`job`, `jobs`), the
  folder lock, the processes a launch owns, multi-node host steps, failures, progress, command-line ends, user input.
- `configs`: validated dataclasses (the training run's `config`, the model's `model_config`, `generation`,
  `rlhf_config`) and which parallel layouts fit a model and a world (`layout`).
- `modeling`: Megatron-Core GPT models built from the configs (`model`), their layer spec and its swaps, emulated FP8.
- `checkpoints`: the cookbook's distributed checkpoints and Hugging Face folders: formats, damage, families and the
  tensor mapping between them.
- `text`: tokenizers (fast and SentencePiece), vocabulary extension, prepared data as training reads it.
- `measures`: what a run reports about itself: throughput, memory, router statistics, logit parity.
- `rl`: the arithmetic of GRPO and PPO, and reward functions.

What a recipe and its worker share is here, so the workers import no recipe.
"""
