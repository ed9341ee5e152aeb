"""The engine every step of the cookbook shares, in the notebook process and in the torchrun workers.

runtime (device, backend, launch environment), compat and standins (the CPU compatibility layer),
launch and worker (the two sides of a torchrun launch: typed jobs as JSON), nodes (host-side steps of
a multi-node job on node 0 only), config and model_config (validated dataclasses), layout (which
parallel layouts fit a model and a world), families and hf_mapping (Hugging Face <-> Megatron-Core
names and shapes), model (Megatron-Core GPT models), checkpoint (atomic, self-describing checkpoints),
tokenizer (load, copy, fingerprint, chat templates, the tiny tokenizer).

What a recipe and its worker share is here too, so the workers import no recipe: jobs (every worker's job but the
training run's), generation and rlhf_config (the knobs those jobs carry), hf_checkpoint (a Hugging Face folder's
headers), logit_parity (the parity figures), indexed_data and sft_data (prepared data as training reads it),
router_stats (an MoE step's router figures), rl_math and reward_functions (GRPO's and PPO's arithmetic and rewards).
"""
