"""The engine every step of the cookbook shares, in the notebook process and in the torchrun workers.

runtime (device, backend, launch environment), compat and standins (the CPU compatibility layer),
launch and worker (the two sides of a torchrun launch: typed jobs as JSON), nodes (host-side steps of
a multi-node job on node 0 only), config and model_config (validated dataclasses), layout (which
parallel layouts fit a model and a world), families and hf_mapping (Hugging Face <-> Megatron-Core
names and shapes), model (Megatron-Core GPT models), checkpoint (atomic, self-describing checkpoints),
tokenizer (load, copy, fingerprint, chat templates, the tiny tokenizer).
"""
