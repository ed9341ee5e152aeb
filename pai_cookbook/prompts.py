"""Prompts for generation: prompt files (JSONL or one per line), chat templates, the tokenizer a
checkpoint carries. All of it runs in the notebook's process, before any worker starts, so a bad file
or a missing tokenizer is reported with its line number or the folder to fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pai_cookbook import checkpoint


def load_tokenizer(ckpt: str | Path):
    """The Hugging Face tokenizer a checkpoint carries in `hf_assets/` (no remote code)."""
    from transformers import AutoTokenizer

    from pai_cookbook.data import TOKENIZER_FILES

    assets = Path(ckpt) / checkpoint.HF_ASSETS
    if not any((assets / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{ckpt} carries no tokenizer: expected one of {list(TOKENIZER_FILES)} (and tokenizer_config.json) in "
            f"{assets}/. Put the model's Hugging Face tokenizer files there, e.g. "
            f"checkpoint.copy_assets(Path('<hf model folder>'), Path('{assets}')); checkpoints converted by "
            f"convert.hf_to_megatron, and training runs started from one, carry them already.")
    return AutoTokenizer.from_pretrained(assets)


def eos_ids(folder: str | Path, tokenizer) -> list[int]:
    """End-of-sequence ids of a Hugging Face folder (a checkpoint's `hf_assets/`): its generation config's
    (Llama 3 lists two), else the tokenizer's."""
    path = Path(folder) / "generation_config.json"
    found = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    if found is None:
        found = tokenizer.eos_token_id
    return [found] if isinstance(found, int) else list(found or [])


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Records of a prompt file: `.jsonl` objects with "prompt" (text) or "messages" (chat), other keys kept;
    any other file: one prompt per non-empty line.

    Raises:
        ValueError: the file is empty, or a line is not a JSON object with a string "prompt" or a
            "messages" list (the message names the line number).
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            records.append({"prompt": line, "line": number})
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}); each line must be "
                             f'one object such as {{"prompt": "..."}}.') from err
        ok = isinstance(record, dict) and (isinstance(record.get("prompt"), str) or isinstance(record.get("messages"), list))
        if not ok:
            raise ValueError(f"{path}:{number}: expected an object with a string \"prompt\" or a \"messages\" list "
                             f"of {{\"role\", \"content\"}}; found {line[:80]!r}.")
        records.append(record | {"line": number})
    if not records:
        raise ValueError(f"{path} holds no prompts (empty or blank lines only); write one prompt per line "
                         f'(.txt) or one {{"prompt": "..."}} object per line (.jsonl).')
    return records


def encode(tokenizer, record: dict[str, Any], chat_template: str) -> list[int]:
    """Token ids of one prompt record, through the chat template when it applies.

    The template's text is tokenized without adding special tokens again (templates write BOS
    themselves); a plain prompt is tokenized exactly as `tokenizer(prompt)` does, as Hugging Face does.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template == "always" and not has_template:
        raise ValueError("chat_template='always' but the checkpoint's tokenizer has no chat template; use 'auto'.")
    use = chat_template == "always" or (chat_template == "auto" and has_template) or "messages" in record
    if not use:
        return tokenizer(record["prompt"]).input_ids
    if not has_template:
        raise ValueError(f"line {record.get('line')}: a \"messages\" prompt needs a tokenizer with a chat template; "
                         f"give a \"prompt\" string instead, or use a checkpoint whose tokenizer has one (after SFT).")
    messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids
