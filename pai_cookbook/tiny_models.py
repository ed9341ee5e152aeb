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

from pai_cookbook import families

TOKENIZER_CORPUS = Path(__file__).resolve().parent.parent / "data" / "tiny_corpus.txt"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
DEFAULT_SHARD_SIZE = "100KB"  # a tiny model still spans several shards: the sharded path is exercised


def make_tokenizer(vocab_size: int, corpus: Path = TOKENIZER_CORPUS):
    """A byte-pair tokenizer with at most `vocab_size` tokens, trained on the cookbook's tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    # limit_alphabet keeps room for merges in a 256-token vocabulary; rarer characters become <unk>.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  limit_alphabet=vocab_size // 2, show_progress=False)
    tokenizer.train([str(corpus)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def randomise_(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Give every parameter distinct random values (norm weights around 1, everything else around 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            param.copy_((base + noise).to(param.dtype))


def make_tiny_hf_model(family: str, folder: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       max_shard_size: str = DEFAULT_SHARD_SIZE, **config_overrides) -> Path:
    """Write a tiny, randomly initialised Hugging Face checkpoint of `family` (with a tokenizer) to `folder`.

    Returns:
        The folder, loadable with AutoModelForCausalLM / AutoTokenizer and by `pai_cookbook.convert`.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    tokenizer = make_tokenizer(families.TINY_HF["vocab_size"])
    config = families.tiny_hf_config(family, bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    randomise_(model, seed)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(folder)
    return folder
