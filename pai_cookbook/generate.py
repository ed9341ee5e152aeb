"""Text generation. For now the Hugging Face baseline that checks an exported model end to end;
Megatron-Core generation (KV cache, TP, sampling parameters) belongs here too."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def hf_complete(hf_dir: str | Path, prompts: Sequence[str], max_new_tokens: int = 32,
                min_new_tokens: int = 0) -> list[str]:
    """Greedy completions of `prompts` by the Hugging Face model in `hf_dir` (fp32, on the CPU).

    min_new_tokens keeps end-of-sequence from ending a completion earlier (tiny demo models stop early).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    completions = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
            completions.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return completions
