"""A prepared set: conversations encoded, audited, split and packed into `out_dir` (train/valid safetensors, sft.json,
chat_template.jinja), checked before any worker starts; what `DataConfig(source="sft")` trains on."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pai_cookbook import chat_template as chat
from pai_cookbook.core.checkpoints import checkpoint
from pai_cookbook.core.launching import inputs, nodes
from pai_cookbook.core.text.sft_data import SUMMARY, SFTError, describe
from pai_cookbook.sft.audit import audit
from pai_cookbook.sft.records import TEMPLATES, Sample, checked_messages, encode_all, read, template_text
from pai_cookbook.sft.rows import batch, efficiency, pack

# --------------------------------------------------------------------------------------------------
# A prepared set: what training reads (source="sft")
# --------------------------------------------------------------------------------------------------
TEMPLATE_FILE = "chat_template.jinja"
SPLITS = ("train", "valid")


@nodes.node0_only
def prepare(source: str | Path | Sequence[dict[str, Any]], out_dir: str | Path, tokenizer_dir: str | Path, *,
            seq_length: int, template: str | None = None, system: str = "keep", stop_tokens: list[str] | None = None,
            check_generation_prompt: bool = True, special_text: str = "refuse", truncation: str = "drop",
            packed: bool = True, valid_fraction: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """Encode, split and pack a conversation set into `out_dir` (train.safetensors, valid.safetensors and
    sft.json), the folder a `DataConfig(source="sft", paths=[out_dir])` trains on. Everything that can be
    wrong with the data is found here, in this process, before any worker starts.

    Args:
        source: a JSONL file (`read`) or conversations already read.
        tokenizer_dir: the tokenizer of the model to be trained (a checkpoint's `hf_assets/`).
        template: None (the tokenizer's chat template), a name in TEMPLATES, or a Jinja template. The template
            used is written into the set (chat_template.jinja) and from there into every checkpoint trained on it.
        system: "keep" the system message, or "fold" it into the first user turn (templates without a system role,
            such as Gemma's).
        stop_tokens: the tokens that end an assistant turn; default: `tokenizer_dir`'s generation_config.json eos
            ids and the tokenizer's eos (`chat_template.stop_ids`).
        check_generation_prompt: False accepts a template whose generation prompt is not what it writes before an
            answer in training (a thinking prompt): the answers are trained as written.
        special_text: "refuse" a conversation whose message types a special token's text (it would be read as
            the control token), or encode such text "as_text" (the lines are counted in `counts.special_as_text`).
        truncation: "drop" or "truncate" conversations longer than seq_length + 1 tokens.
        packed: pack conversations into rows (first-fit decreasing); False: one per row, padded.
        valid_fraction: conversations held out (seeded shuffle) for the validation loss.
    Returns:
        The summary written to sft.json: counts (`Counts`), the masks' `audit`, and per split the
        conversations, rows, loss tokens, packed and padded efficiency and source lines.
    Raises:
        SFTError: naming the line and the way through: bad records, a template that refuses a conversation, cannot
        place or stop a turn, or disagrees with transformers' assistant mask, special-token text inside a message,
        a mask the audit does not reproduce, no conversation left to train on.
    """
    from pai_cookbook.core.text import tokenizer as tokenizers

    _check_out_dir(out_dir)
    inputs.number(valid_fraction, "valid_fraction", low=0, high=1, error=SFTError)
    inputs.integer(seq_length, "seq_length", minimum=2, error=SFTError)
    if isinstance(source, (str, Path)):
        conversations = [c | {"where": f"{source}:{c['line']}"} for c in read(source)]
    else:  # records given in memory get the checks a file's lines get, numbered from 1
        records = inputs.listed(source, "source", "conversations (or a JSONL path)", error=SFTError)
        conversations = [{"messages": checked_messages(record, f"conversation {i}"),
                          "line": record.get("line", i) if isinstance(record, dict) else i}
                         for i, record in enumerate(records, start=1)]
    empty = [c["line"] for c in conversations
             if not any(m["content"].strip() for m in c["messages"] if m["role"] == "assistant")]
    if empty and len(empty) == len(conversations):
        raise SFTError(f"every answer of the {len(conversations)} conversations is empty: only stop tokens would be "
                       f"trained (a model that stops at once). Check which field holds the answers.")
    if empty:
        warnings.warn(f"{len(empty)} of {len(conversations)} conversations have only empty answers (lines "
                      f"{empty[:10]}): they teach the model to stop at once.", stacklevel=2)
    hf = tokenizers.load(tokenizer_dir)
    text = template_text(template) or hf.chat_template
    stops = chat.stop_ids(hf, tokenizer_dir, stop_tokens)
    options = {"stop_ids": stops, "system": system, "check_generation_prompt": check_generation_prompt,
               "special_text": special_text}
    samples, counts = encode_all(hf, conversations, seq_length, template, truncation, **options)
    if counts.disagreements:
        raise SFTError(f"lines {counts.disagreements[:10]}: transformers' assistant mask and the cookbook's "
                       f"mark different tokens; the template's {{% generation %}} markers do not enclose exactly "
                       f"each assistant turn and its end token. Fix the template.")
    if counts.dropped_lines:
        warnings.warn(f"{len(counts.dropped_lines)} of {counts.conversations} conversations dropped "
                      f"({counts.dropped_too_long} longer than seq_length {seq_length} + 1 tokens, "
                      f"{counts.dropped_no_loss} without a loss token): lines {counts.dropped_lines[:10]}",
                      stacklevel=2)
    if len(samples) < (2 if valid_fraction > 0 else 1):
        raise SFTError(f"{len(samples)} of {counts.conversations} conversations are left to train on; need at "
                       f"least {2 if valid_fraction > 0 else 1} (one held out when valid_fraction > 0). Raise "
                       f"seq_length or use truncation='truncate'.")
    checked = audit(hf, samples, conversations, template, stop_ids=stops, system=system, special_text=special_text)
    if checked["mismatched_lines"]:
        raise SFTError(f"lines {checked['mismatched_lines'][:10]}: the trained tokens differ from the audit's second "
                       f"placing of the answers ({'; '.join(checked['mismatches'][:2])}); the template writes text "
                       f"around the answers that one of the two misplaces. Report this with the template, or use "
                       f"another template.")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held_out = max(1, round(valid_fraction * len(samples))) if valid_fraction > 0 else 0
    split = {"train": [samples[i] for i in sorted(order[held_out:])],
             "valid": [samples[i] for i in sorted(order[:held_out])]}
    meta = {"truncation": truncation, "template": template if template is None or template in TEMPLATES else "custom",
            "chat_template": text, "system": system, "stop_tokens": hf.convert_ids_to_tokens(stops),
            "check_generation_prompt": check_generation_prompt, "special_text": special_text,
            "tokenizer": str(Path(tokenizer_dir).resolve()), "tokenizer_sha256": tokenizers.fingerprint(tokenizer_dir),
            "vocab_size": len(hf), "counts": asdict(counts), "audit": checked}
    pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    return write(out_dir, split, seq_length, pad_id, packed=packed, **meta)


def write(out_dir: str | Path, split: dict[str, Sequence[Sample]], seq_length: int, pad_id: int, *,
          packed: bool = True, **meta: Any) -> dict[str, Any]:
    """Pack (or pad) each split's samples into rows and write them with the summary; the folder appears
    whole or not at all (written beside it, then renamed). `meta` joins the summary (`vocab_size` is
    needed by `check_for_training`)."""
    # derived data: a new preparation replaces the old one whole; a full disk (an OSError, or safetensors'
    # SafetensorError) is said as such, with the folder
    with replacing(_check_out_dir(out_dir)) as partial:
        return _write_splits(partial, split, seq_length, pad_id, packed, meta)


@contextlib.contextmanager
def replacing(out: str | Path, then: str = "nothing was kept; give another out_dir") -> Iterator[Path]:
    """A fresh `<out>.partial` to write derived data into (a prepared set): when the block completes it replaces `out`
    whole (the old one set aside as `<out>.old` until the new one is in place); when it fails it is removed and `out`
    is left as it was. A full disk is said as such, naming the folder (`checkpoint.full_disk_said`)."""
    out = Path(out)
    partial = checkpoint.partial_dir(out)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with checkpoint.full_disk_said(partial, then=then):
        try:
            yield partial
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    old = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(partial, out)
    shutil.rmtree(old, ignore_errors=True)


def _check_out_dir(out_dir: str | Path) -> Path:
    """A folder a prepared set may be written to: new, empty, or holding a prepared set (which is replaced)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SFTError(f"{out_dir} is a file, not a folder; choose another folder for the prepared set.")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / SUMMARY).exists():
        raise SFTError(f"{out_dir} holds files that are not a prepared SFT set; give an empty or new folder (a "
                       f"prepared set there is replaced, nothing else is).")
    return out_dir


def _write_splits(folder: Path, split: dict[str, Sequence[Sample]], seq_length: int, pad_id: int, packed: bool,
                  meta: dict[str, Any]) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    summary: dict[str, Any] = {"seq_length": seq_length, "packed": packed} | meta
    template = summary.pop("chat_template", None)
    if template:  # the template the set was rendered with: training writes it into its checkpoints' hf_assets
        (folder / TEMPLATE_FILE).write_text(template, encoding="utf-8")
    for name in SPLITS:
        part = list(split.get(name, []))
        lengths = [len(s.ids) - 1 for s in part]
        rows = pack(lengths, seq_length) if packed else [[i] for i in range(len(part))]
        tensors = batch(part, rows, seq_length, pad_id) if part else {}
        save_file({k: v.to(getattr(torch, _STORED[k])).contiguous() for k, v in tensors.items()},
                  str(folder / f"{name}.safetensors"))
        summary[name] = {"conversations": len(part), "rows": len(rows), "positions": sum(lengths),
                         "loss_tokens": sum(sum(s.loss_mask[1:]) for s in part),
                         "efficiency": sum(lengths) / (len(rows) * seq_length) if rows else 0.0,
                         "padded_efficiency": efficiency(lengths, seq_length, packed=False),
                         "packed_efficiency": efficiency(lengths, seq_length, packed=True),
                         "lines": [s.line for s in part]}
    (folder / SUMMARY).write_text(json.dumps(summary, indent=1))
    return summary


_STORED = {"tokens": "int32", "labels": "int32", "loss_mask": "uint8", "document": "int32"}


def check_for_training(run: Any) -> None:
    """Before launch: the set exists, was prepared at this seq_length with this model's tokenizer, holds a
    global batch, and has validation rows when the run evaluates.

    Raises:
        SFTError: naming what differs and how to fix it.
    """
    from pai_cookbook.core.checkpoints import checkpoint
    from pai_cookbook.core.text import tokenizer as tokenizers

    folder = run.data.paths[0]
    summary = describe(folder)
    if summary["seq_length"] != run.data.seq_length:
        raise SFTError(f"{folder} was packed into rows of {summary['seq_length']} positions, the run's seq_length is "
                       f"{run.data.seq_length}; prepare it again with seq_length={run.data.seq_length}.")
    if summary["vocab_size"] > run.model.vocab_size:
        raise SFTError(f"{folder} was tokenized with a {summary['vocab_size']}-token vocabulary, larger than the "
                       f"model's {run.model.vocab_size}; prepare it with this model's tokenizer.")
    if summary["packed"] and run.model.position_embedding_type != "rope":
        raise SFTError(f"{folder} packs several conversations per row, and the model's positions are "
                       f"{run.model.position_embedding_type!r}: a packed conversation would see other positions than "
                       f"alone (rotary scores depend only on distances). Prepare it with packed=False.")
    load_dir = run.checkpoint.load_dir
    expected = tokenizers.fingerprint(Path(load_dir) / checkpoint.HF_ASSETS) if load_dir else None
    if expected and summary.get("tokenizer_sha256") != expected:
        raise SFTError(f"{folder} was tokenized with {summary.get('tokenizer', 'a tokenizer it does not name')}, not "
                       f"with the tokenizer of {load_dir}; "
                       f"prepare it again with tokenizer_dir={Path(load_dir) / checkpoint.HF_ASSETS}.")
    if summary["train"]["rows"] < run.data.global_batch_size:
        raise SFTError(f"{folder} packs into {summary['train']['rows']} training rows, fewer than one global batch "
                       f"({run.data.global_batch_size}); use a smaller global_batch_size or more data.")
    if run.eval_interval and not summary["valid"]["rows"]:
        raise SFTError(f"{folder} holds no validation conversations and the run evaluates (eval_interval="
                       f"{run.eval_interval}); prepare it with valid_fraction > 0, or set eval_interval=0.")


