"""The figures of a parity check: a fixed batch of the cookbook's corpus in the model's own tokens (`token_batch`),
transformers' logits on it (`hf_logits`), and two logit tensors over the same tokens compared (`compare_logits`). The
parity recipe (`pai_cookbook.parity`) asks for them; the parity worker computes them."""

from __future__ import annotations

from pathlib import Path

import torch

from pai_cookbook.core.launching.progress import quiet_transformers
from pai_cookbook.core.text.tokenizer import TOKENIZER_CORPUS

DEFAULT_BATCH, DEFAULT_SEQ = 2, 32


def token_batch(tokenizer_dir: str | Path, batch: int = DEFAULT_BATCH, seq: int = DEFAULT_SEQ) -> torch.Tensor:
    """`batch` windows of `seq` tokens of the cookbook's corpus, tokenized by the model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(TOKENIZER_CORPUS.read_text(), add_special_tokens=False).input_ids
    if len(ids) < batch * seq:
        raise ValueError(f"the corpus gives {len(ids)} tokens, fewer than batch x seq = {batch * seq}")
    return torch.tensor(ids[:batch * seq]).view(batch, seq)


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   tokens[:, 1:].reshape(-1)))


def compare_logits(hf: torch.Tensor, mcore: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """Parity figures of two [batch, seq, vocab] fp32 logit tensors over the same tokens."""
    a, b = hf.double().flatten(), mcore.double().flatten()
    diff = (hf - mcore).abs()
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "argmax_agreement": float((hf.argmax(-1) == mcore.argmax(-1)).double().mean()),
        "hf_loss": _next_token_loss(hf, tokens),
        "megatron_loss": _next_token_loss(mcore, tokens),
        # the first sample alone: the seed project's "single-sample forward loss"
        "hf_sample_loss": _next_token_loss(hf[:1], tokens[:1]),
        "megatron_sample_loss": _next_token_loss(mcore[:1], tokens[:1]),
    }


def hf_model(hf_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' causal LM from `hf_dir` in `dtype` on `device`, without its "Loading weights" bar."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> torch.Tensor:
    """transformers' logits for `tokens`, computed in `dtype` on `device`, returned in fp32 on the CPU."""
    model = hf_model(hf_dir, dtype, device)
    with torch.no_grad():
        return model(tokens.to(device)).logits.float().cpu()
