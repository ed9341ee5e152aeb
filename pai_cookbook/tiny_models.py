"""Tiny Hugging Face models made on this machine: what tests and CPU notebooks convert and train.

No model hub is needed: `make_tiny_hf_model("qwen2", folder)` writes a real, sharded Hugging Face
checkpoint (config.json, model-0000X-of-0000N.safetensors, the index json, tokenizer files) through
`transformers`' own `save_pretrained`, so it goes through exactly the loading code a real download does.
Every weight is randomised, norms and biases included (transformers initialises those to ones and
zeros), so a conversion that swapped, dropped or misplaced a tensor cannot go unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pai_cookbook.core import families, nodes, tokenizer
from pai_cookbook.core.progress import quiet_transformers
from pai_cookbook.core.tokenizer import TOKENIZER_CORPUS  # noqa: F401  (the corpus tests and notebooks read)

DEFAULT_SHARD_SIZE = "100KB"  # a tiny model still spans several shards: the sharded path is exercised


# Buffers a checkpoint carries as weights (DeepSeek-V3's router bias, which transformers initialises to zeros), and
# their spread: a few hundredths, as large as the differences between a tiny router's sigmoid scores, so the bias
# changes which experts are chosen.
_WEIGHT_BUFFERS = {"e_score_correction_bias": 0.05}


def randomise_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Give every parameter distinct random values (norm weights around 1, everything else around 0), and the buffers a
    checkpoint stores as weights too (`_WEIGHT_BUFFERS`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            param.copy_((base + noise).to(param.dtype))
        for name, buffer in model.named_buffers():
            spread = _WEIGHT_BUFFERS.get(name.rsplit(".", 1)[-1])
            if spread is not None:
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * spread)


@nodes.node0_only
def make_tiny_hf_model(family: str, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       max_shard_size: str = DEFAULT_SHARD_SIZE, tokenizer_dir: str | Path | None = None,
                       chat_template: str | None = None, **config_overrides) -> Path:
    """Write a tiny, randomly initialised Hugging Face checkpoint of `family` (with a tokenizer) to `folder`.

    Args:
        tokenizer_dir: a Hugging Face tokenizer folder to give the model (its vocabulary size with it);
            None: the cookbook's 256-token tiny tokenizer.
        chat_template: a Jinja chat template the tokenizer carries from then on (into checkpoints,
            inference and export); None keeps the tokenizer's own.
    Returns:
        The folder, loadable with AutoModelForCausalLM / AutoTokenizer and by `pai_cookbook.convert`.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    tiny_tokenizer = tokenizer.load(tokenizer_dir) if tokenizer_dir is not None else tokenizer.tiny()
    if tokenizer_dir is not None:
        config_overrides.setdefault("vocab_size", len(tiny_tokenizer))
    config = families.tiny_hf_config(family, bos_token_id=tiny_tokenizer.bos_token_id,
                                     eos_token_id=tiny_tokenizer.eos_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    randomise_(model, seed)
    with quiet_transformers():
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    if chat_template is not None:
        tiny_tokenizer.chat_template = chat_template
    tiny_tokenizer.save_pretrained(folder)
    if tokenizer_dir is not None:  # the vocabulary as the user has it, byte for byte (a fast tokenizer saves no
        tokenizer.copy(tokenizer_dir, folder, tokenizer.VOCABULARY_FILES)  # tokenizer.model): same fingerprint
    return folder
