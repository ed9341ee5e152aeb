"""Supervised fine-tuning data: conversations -> token ids with an answer-only loss mask, then packed.

    summary = sft.prepare("data/sft/arithmetic.jsonl", "runs/sft_data", tokenizer_dir, seq_length=512)
    config = RunConfig(..., data=DataConfig(source="sft", paths=["runs/sft_data"], seq_length=512))

or step by step:

    conversations = sft.read("data/sft/arithmetic.jsonl")    # "messages", or "prompt"/"response" records
    samples, counts = sft.encode_all(tokenizer, conversations, seq_length=512)
    rows = sft.pack([len(s.ids) - 1 for s in samples], 512)  # first-fit decreasing, no sample split
    batch = sft.batch(samples, rows, 512, pad_id)             # tokens, labels, loss_mask, document ids

The whole conversation is rendered once with the tokenizer's chat template (or a named one) and tokenized
once; each assistant turn, from the end of its generation prompt through its stop token, carries the loss,
nothing else does (`chat_template`, which places the messages and refuses what cannot be trained right, naming
the line and the way through). Where the template marks assistant turns with `{% generation %}`, transformers'
assistant mask must agree; `audit` places the answers a second way and compares token by token. What SFT tools
get wrong is refused or counted here: prompt tokens in the loss, the stop token left out (the model never learns
to stop) or typed inside an answer, a second BOS, samples without a single loss token.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pai_cookbook import chat_template as chat
from pai_cookbook.chat_template import SFTError
from pai_cookbook.core import inputs, nodes

ROLES = ("system", "user", "assistant")
DEFAULT_SET = Path(__file__).resolve().parents[1] / "data" / "sft" / "arithmetic.jsonl"
"""The cookbook's instruction set (scripts/make_sft_data.py): arithmetic asked in ten phrasings, answered in
one format, one to six turns per conversation."""
DEFAULT_TEST_SET = DEFAULT_SET.with_name("arithmetic_test.jsonl")
"""64 held-out first questions with their answers: {"prompt", "answer"} per line."""
TRUNCATION = ("drop", "truncate")

# ChatML with the assistant turns marked for transformers' assistant mask: what SmolLM2's and Qwen2's own
# templates render for a conversation that has a system message, and a template for tokenizers without one.
CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}{{ message['content'] + '<|im_end|>' + '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
TEMPLATES = {"chatml": CHATML}


@dataclass
class Sample:
    """One conversation as the model trains on it."""

    ids: list[int]
    loss_mask: list[bool]
    """True on the tokens whose prediction is trained: each assistant turn's tokens and its end token."""
    line: int = 0
    """The JSONL line it came from (1-based)."""
    template_agrees: bool | None = None
    """Whether transformers' assistant mask equals the cookbook's (None: the template has no markers)."""
    truncated: bool = False
    """Cut at seq_length + 1 tokens (`encode_all` with truncation="truncate")."""


@dataclass
class Counts:
    """What `encode_all` did to a data set."""

    conversations: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    dropped_no_loss: int = 0
    cross_checked: int = 0
    disagreements: list[int] = field(default_factory=list)
    """Lines whose template mask and the cookbook's differ."""
    dropped_lines: list[int] = field(default_factory=list)
    """Lines of the conversations dropped (too long, or no loss token left)."""


def read(path: str | Path) -> list[dict[str, Any]]:
    """Conversations of a JSONL file: {"messages": [{"role", "content"}, ...]} or {"prompt", "response"
    [, "system"]} per line. Returns [{"messages": [...], "line": n}].

    Raises:
        SFTError: naming the file and line of a malformed record, an unknown role, or a conversation
        without an assistant turn.
    """
    path = Path(path)
    out = []
    for number, text in enumerate(inputs.read_text(path, what="conversations file", error=SFTError).splitlines(),
                                  start=1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise SFTError(f"{where} is not JSON ({err.msg}); each line must be one JSON object.") from None
        out.append({"messages": _messages(record, where), "line": number})
    if not out:
        raise SFTError(f"{path} holds no conversations; write one JSON object per line.")
    return out


def _messages(record: Any, where: str) -> list[dict[str, str]]:
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
    elif isinstance(record, dict) and {"prompt", "response"} <= set(record):
        messages = ([{"role": "system", "content": record["system"]}] if record.get("system") else []) + [
            {"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise SFTError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\", \"response\"}}, found {found}.")
    inputs.messages(messages, where, error=SFTError)
    for turn in messages:
        if turn["role"] not in ROLES:
            raise SFTError(f"{where}: unknown role {turn['role']!r}; the roles are {list(ROLES)}.")
    first = next((turn["role"] for turn in messages if turn["role"] != "system"), None)
    if first is None:
        raise SFTError(f"{where}: the conversation has only system messages, no question and no answer to learn; "
                       f"add a \"user\" turn and its \"assistant\" answer, or remove it.")
    if first == "assistant":
        raise SFTError(f"{where}: the conversation starts with an assistant turn; an answer needs a question "
                       f"before it (a \"user\" turn), or the template's header of it would be trained.")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise SFTError(f"{where}: the conversation has no assistant turn, so nothing to learn from it; "
                       f"add the answer as an \"assistant\" turn (or a \"response\").")
    return [{"role": turn["role"], "content": turn["content"]} for turn in messages]


def read_template(spec: str | Path | None) -> str | None:
    """A chat template named by a notebook parameter (`chat_template.read`): empty (the tokenizer's own), a name
    of TEMPLATES, a .jinja file, a model folder, or Jinja text."""
    return chat.read(spec, TEMPLATES)


def _template(template: str | None) -> str | None:
    """A template as its Jinja text (`read_template`: a name of TEMPLATES, a file, a folder or Jinja text; anything
    else is refused); None: the tokenizer's own."""
    spec = read_template(template)
    return TEMPLATES.get(spec, spec) if spec is not None else None


def _where(conversation: dict[str, Any]) -> str:
    return conversation.get("where") or f"line {conversation.get('line', 0)}"


def encode(tokenizer, conversation: dict[str, Any], template: str | None = None, *, stop_ids: list[int] | None = None,
           system: str = "keep", check_generation_prompt: bool = True) -> Sample:
    """One conversation rendered and tokenized once, with its answer-only loss mask (`chat_template`: each assistant
    turn from the end of its generation prompt through its stop token), cross-checked against transformers'
    assistant mask where the template marks assistant turns with `{% generation %}`.

    Args:
        stop_ids: the ids that end a turn; default `chat_template.stop_ids(tokenizer)`: the generation config's eos
            ids in the folder the tokenizer was loaded from, and the tokenizer's eos.
        system: "keep", or "fold" the system message into the first user turn (templates without a system role).
        check_generation_prompt: refuse a template whose generation prompt is not what it writes before an answer.
    Raises:
        SFTError: naming the conversation's line and the way through (`chat_template`'s refusals).
    """
    if system not in chat.SYSTEM:
        raise SFTError(f"system={system!r}; use one of {chat.SYSTEM}.")
    if not isinstance(conversation, dict) or "messages" not in conversation:
        raise SFTError(f"expected a conversation {{\"messages\": [...]}} (as sft.read gives), found "
                       f"{conversation!r:.80}; read records with sft.read(...) first.")
    where = _where(conversation)
    messages, template = _messages(conversation, where), _template(template)
    if system == "fold":
        messages = chat.fold_system(messages)
    stops = stop_ids if stop_ids is not None else chat.stop_ids(tokenizer)
    located = chat.locate(tokenizer, messages, template, where, check_generation_prompt)
    ids, mask = chat.mask(tokenizer, located, stops, where)
    agrees = None
    if "{% generation %}" in (template or tokenizer.chat_template or ""):
        marked = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
        agrees = marked["input_ids"] == ids and [bool(m) for m in marked["assistant_masks"]] == mask
    return Sample(ids=ids, loss_mask=mask, line=conversation.get("line", 0), template_agrees=agrees)


def encode_all(tokenizer, conversations: Sequence[dict[str, Any]], seq_length: int, template: str | None = None,
               truncation: str = "drop", **options: Any) -> tuple[list[Sample], Counts]:
    """Every conversation encoded (`options`: `encode`'s); longer than `seq_length` + 1 tokens (inputs and the
    shifted labels) dropped or truncated; samples left without a loss token dropped. Returns the samples and the
    counts: every conversation is kept (truncated or not), dropped too long, or dropped without a loss token."""
    if truncation not in TRUNCATION:
        raise SFTError(f"truncation={truncation!r}; use one of {TRUNCATION}.")
    template = _template(template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise SFTError(f"the tokenizer has no chat template; pass template= one of {sorted(TEMPLATES)} or your own.")
    counts, samples = Counts(conversations=len(conversations)), []
    for conversation in conversations:
        sample = encode(tokenizer, conversation, template, **options)
        if sample.template_agrees is not None:
            counts.cross_checked += 1
            if not sample.template_agrees:
                counts.disagreements.append(sample.line)
        if len(sample.ids) > seq_length + 1:
            if truncation == "drop":
                counts.dropped_too_long += 1
                counts.dropped_lines.append(sample.line)
                continue
            sample.ids, sample.loss_mask = sample.ids[:seq_length + 1], sample.loss_mask[:seq_length + 1]
            sample.truncated = True
        if not any(sample.loss_mask[1:]):  # the first token is never predicted
            counts.dropped_no_loss += 1
            counts.dropped_lines.append(sample.line)
            continue
        counts.truncated += sample.truncated
        samples.append(sample)
    return samples, counts


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into bins of at most `capacity` tokens, no item
    split. Longest first, each into the first bin it fits; within a bin in that order.

    Raises:
        SFTError: an item is longer than `capacity` (drop or truncate it first: `encode_all`).
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise SFTError(f"items {too_long[:5]} are longer than the pack capacity {capacity}; encode_all drops or "
                       f"truncates them.")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def efficiency(lengths: Sequence[int], capacity: int, packed: bool) -> float:
    """Fraction of the tokens in the sequences that are real: packed into `pack`'s bins, or one sample per
    sequence padded to `capacity`."""
    sequences = len(pack(lengths, capacity)) if packed else len(lengths)
    return sum(lengths) / (sequences * capacity) if sequences else 0.0


# --------------------------------------------------------------------------------------------------
# Batches: packed (several conversations per sequence, attention kept inside each) or padded
# --------------------------------------------------------------------------------------------------
def batch(samples: Sequence[Sample], rows: Sequence[Sequence[int]], seq_length: int, pad_id: int) -> dict[str, Any]:
    """Model inputs for `rows` (each a list of indices into `samples`, packed in that order into one
    sequence of `seq_length`): tokens, labels, loss_mask and `document` (which conversation each position
    belongs to, -1 for padding), from which `attention_mask` builds the block-diagonal causal mask.

    A sample of n ids fills n - 1 positions: inputs ids[:-1], labels ids[1:], trained where its mask says.
    Padded batches are the same with one sample per row.
    """
    import torch

    shape = (len(rows), seq_length)
    tokens, labels = torch.full(shape, pad_id, dtype=torch.long), torch.full(shape, pad_id, dtype=torch.long)
    loss_mask, document = torch.zeros(shape), torch.full(shape, -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            ids, mask = samples[i].ids, samples[i].loss_mask
            n = len(ids) - 1
            if at + n > seq_length:
                raise SFTError(f"row {r} holds {at + n} positions, more than seq_length {seq_length}; pack with "
                               f"capacity seq_length over len(ids) - 1.")
            tokens[r, at:at + n] = torch.tensor(ids[:-1])
            labels[r, at:at + n] = torch.tensor(ids[1:])
            loss_mask[r, at:at + n] = torch.tensor(mask[1:], dtype=torch.float)
            document[r, at:at + n] = d
            at += n
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "document": document}


def thd(batch: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch of packed rows as Megatron-Core's THD packed sequence (Transformer Engine): the rows
    laid end to end as one row, `cu_seqlens` the offsets where each conversation (and each row's padding
    tail) starts, plus the total, and `max_seqlen` the longest. Attention and rotary positions then restart
    at every offset; per-position tensors keep their order, so losses line up with the loss mask."""
    import torch

    rows, seq = batch["tokens"].shape
    segment = (torch.arange(rows)[:, None] * (seq + 1) + batch["document"] + 1).reshape(-1)  # unique per (row, doc)
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[1:] = segment[1:] != segment[:-1]
    cu_seqlens = torch.cat([torch.nonzero(starts).view(-1), torch.tensor([rows * seq])]).to(torch.int32)
    out = {key: value.reshape(1, -1) if torch.is_tensor(value) and value.dim() == 2 else value
           for key, value in batch.items() if key != "document"}
    return out | {"cu_seqlens": cu_seqlens, "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max())}


def attention_mask(document: Any) -> Any:
    """Megatron-Core's boolean attention mask [batch, 1, seq, seq] (True: masked) that keeps attention causal
    and inside each conversation of a packed row; a padding position sees only itself.

    With this mask rotary embeddings need no per-conversation reset: RoPE scores depend only on the distance
    between two positions, which packing does not change inside a conversation (tests compare packed and
    padded logits).
    """
    import torch

    seq = document.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document.device).tril()
    same = document[:, :, None] == document[:, None, :]
    pad_self = torch.eye(seq, dtype=torch.bool, device=document.device) & (document < 0)[:, :, None]
    keep = (same & causal & (document >= 0)[:, :, None]) | pad_self
    return ~keep[:, None]


# --------------------------------------------------------------------------------------------------
# A prepared set: what training reads (source="sft")
# --------------------------------------------------------------------------------------------------
SUMMARY = "sft.json"
TEMPLATE_FILE = "chat_template.jinja"
SPLITS = ("train", "valid")


@nodes.node0_only
def prepare(source: str | Path | Sequence[dict[str, Any]], out_dir: str | Path, tokenizer_dir: str | Path, *,
            seq_length: int, template: str | None = None, system: str = "keep", stop_tokens: list[str] | None = None,
            check_generation_prompt: bool = True, truncation: str = "drop", packed: bool = True,
            valid_fraction: float = 0.05, seed: int = 0) -> dict[str, Any]:
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
    from pai_cookbook.core import tokenizer as tokenizers

    _check_out_dir(out_dir)
    inputs.number(valid_fraction, "valid_fraction", low=0, high=1, error=SFTError)
    inputs.integer(seq_length, "seq_length", minimum=2, error=SFTError)
    if isinstance(source, (str, Path)):
        conversations = [c | {"where": f"{source}:{c['line']}"} for c in read(source)]
    else:  # records given in memory get the checks a file's lines get, numbered from 1
        records = inputs.listed(source, "source", "conversations (or a JSONL path)", error=SFTError)
        conversations = [{"messages": _messages(record, f"conversation {i}"),
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
    text = _template(template) or hf.chat_template
    stops = chat.stop_ids(hf, tokenizer_dir, stop_tokens)
    options = {"stop_ids": stops, "system": system, "check_generation_prompt": check_generation_prompt}
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
    checked = audit(hf, samples, conversations, template, stop_ids=stops, system=system)
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
            "check_generation_prompt": check_generation_prompt,
            "tokenizer": str(Path(tokenizer_dir).resolve()), "tokenizer_sha256": tokenizers.fingerprint(tokenizer_dir),
            "vocab_size": len(hf), "counts": asdict(counts), "audit": checked}
    pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    return write(out_dir, split, seq_length, pad_id, packed=packed, **meta)


def write(out_dir: str | Path, split: dict[str, Sequence[Sample]], seq_length: int, pad_id: int, *,
          packed: bool = True, **meta: Any) -> dict[str, Any]:
    """Pack (or pad) each split's samples into rows and write them with the summary; the folder appears
    whole or not at all (written beside it, then renamed). `meta` joins the summary (`vocab_size` is
    needed by `check_for_training`)."""
    out_dir = _check_out_dir(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        summary = _write_splits(partial, split, seq_length, pad_id, packed, meta)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            raise OSError(err.errno, f"No space left on device while writing the SFT set {partial} "
                                     f"({shutil.disk_usage(partial.parent).free} bytes free); nothing was kept. Free "
                                     f"space or give another out_dir.") from err
        raise
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():  # derived data: a new preparation replaces the old one whole
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return summary


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


def describe(folder: str | Path) -> dict[str, Any]:
    """The summary of a prepared set; a clear error when the folder is not one."""
    path = Path(folder) / SUMMARY
    if not path.exists():
        raise SFTError(f"{folder} is not a prepared SFT set (no {SUMMARY}); write it with sft.prepare(...).")
    return inputs.read_json(path, fix="Prepare the set again with sft.prepare(...).", error=SFTError)


def check_for_training(run: Any) -> None:
    """Before launch: the set exists, was prepared at this seq_length with this model's tokenizer, holds a
    global batch, and has validation rows when the run evaluates.

    Raises:
        SFTError: naming what differs and how to fix it.
    """
    from pai_cookbook.core import checkpoint
    from pai_cookbook.core import tokenizer as tokenizers

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
        raise SFTError(f"{folder} was tokenized with {summary['tokenizer']}, not with the tokenizer of {load_dir}; "
                       f"prepare it again with tokenizer_dir={Path(load_dir) / checkpoint.HF_ASSETS}.")
    if summary["train"]["rows"] < run.data.global_batch_size:
        raise SFTError(f"{folder} packs into {summary['train']['rows']} training rows, fewer than one global batch "
                       f"({run.data.global_batch_size}); use a smaller global_batch_size or more data.")
    if run.eval_interval and not summary["valid"]["rows"]:
        raise SFTError(f"{folder} holds no validation conversations and the run evaluates (eval_interval="
                       f"{run.eval_interval}); prepare it with valid_fraction > 0, or set eval_interval=0.")


def load(folder: str | Path, split: str) -> dict[str, Any]:
    """The rows of one split of a prepared set: tokens, labels, loss_mask, document (int64 / float)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / f"{split}.safetensors"))
    return {k: v.float() if k == "loss_mask" else v.long() for k, v in tensors.items()}


def global_batch(rows: dict[str, Any], step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int, average: str = "token", shuffle: bool = True) -> list[dict[str, Any]]:
    """This DP rank's micro-batches of global batch `step`: rows [step x GBS, (step + 1) x GBS) of a stream
    that runs through the set epoch after epoch, each epoch in its own seeded order (`shuffle`) or in
    order. The same rows at every layout, and a resumed run continues where it stopped.

    Each micro-batch carries `loss_mask` as loss weights and `loss_count`, what they sum to: per token
    (weights 0/1, the count of loss tokens) or per sample (each conversation's tokens weigh 1/its loss
    tokens, the count of conversations), so the global batch's loss is sum / count whatever the split.
    """
    import torch

    n = rows["tokens"].shape[0]
    per_rank = global_batch_size // dp_size
    first = step * global_batch_size + dp_rank * per_rank
    orders: dict[int, list[int]] = {}

    def row(k: int) -> int:
        epoch = k // n
        if epoch not in orders:
            orders[epoch] = (torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
                             .tolist() if shuffle else list(range(n)))
        return orders[epoch][k % n]

    picked = torch.tensor([row(k) for k in range(first, first + per_rank)])
    out = []
    for i in range(0, per_rank, micro_batch_size):
        mb = {key: value[picked[i:i + micro_batch_size]] for key, value in rows.items()}
        mb["loss_mask"], mb["loss_count"] = loss_weights(mb["loss_mask"], mb["document"], average)
        out.append(mb)
    return out


def loss_weights(loss_mask: Any, document: Any, average: str) -> tuple[Any, Any]:
    """(weights, count) of a micro-batch: per token, the mask and its sum; per sample, each conversation's
    loss tokens weighted 1 / their number, and the number of conversations with a loss token."""
    import torch

    mask = loss_mask.float()
    if average == "token":
        return mask, mask.sum().round().int()
    if document is None:  # one sample per row
        document = torch.zeros_like(mask, dtype=torch.long)
    # a conversation is (row, document id): number them across the micro-batch
    key = torch.arange(mask.shape[0]).unsqueeze(1) * (int(document.max()) + 2) + document + 1
    sizes = torch.zeros(int(key.max()) + 1).index_add_(0, key.view(-1), mask.view(-1))
    per_token = sizes[key]
    weights = torch.where(mask > 0, mask / per_token.clamp(min=1), torch.zeros_like(mask))
    return weights, torch.tensor(int((sizes > 0).sum()), dtype=torch.int)


def loss_by_split(token_losses: Any, loss_mask: Any, micro_batch_sizes: Sequence[int]) -> dict[int, dict[str, float]]:
    """The loss of one global batch ([rows, seq] per-token losses and 0/1 mask) as each micro-batch size
    would report it: per token over the whole batch (Megatron-Core's per-token loss: the same for every
    split) and as the mean of micro-batch means (what a loop that averages per micro-batch reports and
    trains on: rows with fewer loss tokens weigh more, by an amount that depends on the split)."""
    losses, mask = token_losses.double(), loss_mask.double()
    out = {}
    for size in micro_batch_sizes:
        means = [float((losses[i:i + size] * mask[i:i + size]).sum() / mask[i:i + size].sum())
                 for i in range(0, losses.shape[0], size)]
        out[size] = {"per_token": float((losses * mask).sum() / mask.sum()), "mean_of_means": sum(means) / len(means)}
    return out


# --------------------------------------------------------------------------------------------------
# Looking at the data and at what the model learnt
# --------------------------------------------------------------------------------------------------
def audit(tokenizer, samples: Sequence[Sample], conversations: Sequence[dict[str, Any]], template: str | None = None,
          *, stop_ids: list[int] | None = None, system: str = "keep") -> dict[str, Any]:
    """What the loss masks train, checked token by token against a second, independent placing of the answers: the
    conversation is rendered and tokenized again, each answer found by searching its text forward from the message
    before, and each generation prompt (what `add_generation_prompt=True` adds) searched before it. A turn's trained
    tokens must be exactly those from the end of its generation prompt (the answer's first token when the prompt is
    not there) through the first stop token after the answer, however the boundaries merge; nothing else is trained,
    and no sample starts with two BOS tokens. A mismatch names the line, the turn and the tokens on both sides."""
    by_line = {c["line"]: c for c in conversations}
    if len(by_line) != len(conversations):
        raise SFTError("conversations share line numbers; give each a distinct \"line\" (or none: sft.prepare numbers them).")
    unknown = sorted({s.line for s in samples} - set(by_line))
    if unknown:
        raise SFTError(f"samples of lines {unknown[:10]} have no conversation among those given (lines "
                       f"{sorted(by_line)[:10]}); pass the conversations the samples were encoded from.")
    template = _template(template)
    stops = stop_ids if stop_ids is not None else chat.stop_ids(tokenizer)
    out: dict[str, Any] = {"samples": len(samples), "truncated_not_checked": 0, "assistant_turns": 0,
                           "stop_tokens_trained": 0, "mismatched_samples": 0, "double_bos": 0, "mismatched_lines": [],
                           "mismatches": []}
    bos = tokenizer.bos_token_id
    for sample in samples:
        out["double_bos"] += bos is not None and sample.ids[:2] == [bos, bos]
        if sample.truncated:  # its last answer is cut: the turn check does not apply
            out["truncated_not_checked"] += 1
            continue
        messages = by_line[sample.line]["messages"]
        messages = chat.fold_system(messages) if system == "fold" else messages
        expected, turns = _expected_mask(tokenizer, messages, template, stops)
        out["assistant_turns"] += turns
        out["stop_tokens_trained"] += sum(m and i in stops for i, m in zip(sample.ids, sample.loss_mask))
        if expected is None or expected[0] != sample.ids or expected[1] != sample.loss_mask:
            out["mismatched_samples"] += 1
            out["mismatched_lines"].append(sample.line)
            if len(out["mismatches"]) < 5:
                out["mismatches"].append(_difference(tokenizer, sample, expected, stops))
    return out


def _expected_mask(tokenizer, messages: list[dict], template: str | None, stops: list[int]):
    """(ids, mask) by the audit's own placing (`audit`), and the number of assistant turns; (None, n) when an
    answer or its stop token is not found."""
    text = chat.render(tokenizer, messages, template)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    mask, turns, pos = [False] * len(ids), 0, 0
    for i, message in enumerate(messages):
        core = message["content"].strip()
        at = text.find(core, pos)
        if message["role"] != "assistant":
            if at >= 0 and message["role"] != "system":  # a template may move the system message (Mistral's last turn)
                pos = at + len(core)
            continue
        turns += 1
        if at < 0:
            return None, turns
        full = chat.render(tokenizer, messages[:i], template, generation_prompt=True)
        bare = chat.render(tokenizer, messages[:i], template)
        common = next((k for k, (x, y) in enumerate(zip(full, bare)) if x != y), min(len(full), len(bare)))
        prompt = full[common:]
        found = text.rfind(prompt, pos, at + len(prompt)) if prompt else -1
        end = at + len(core)
        if found >= 0 and found + len(prompt) <= at:  # the model writes everything after its generation prompt
            start = found + len(prompt)
        else:  # no generation prompt there: the answer as written, its leading whitespace too if the template keeps it
            lead = message["content"][:len(message["content"]) - len(message["content"].lstrip())]
            trimmed = messages[:i] + [message | {"content": message["content"].lstrip()}] + messages[i + 1:]
            kept = lead and text[max(pos, at - len(lead)):at] == lead and chat.render(tokenizer, trimmed, template) != text
            start = at - len(lead) if kept else at
        stop = next((k for k, (a, _) in enumerate(offsets) if ids[k] in stops and a >= end), None)
        if stop is None:
            return None, turns
        for k, token in enumerate(offsets):
            if chat.overlaps(token, start, offsets[stop][1]):
                mask[k] = True
        pos = offsets[stop][1]
    return (ids, mask), turns


def _difference(tokenizer, sample: Sample, expected, stops: list[int]) -> str:
    """Where a sample's trained tokens and the audit's differ, with the tokens on both sides."""
    if expected is None:
        return f"line {sample.line}: the audit finds no answer, or no stop token after one, in the rendered text"
    ids, mask = expected
    if ids != sample.ids:
        return f"line {sample.line}: the tokens differ from a second tokenization of the same text"
    ours = [tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, sample.loss_mask) if m]
    theirs = [tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]
    k = next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
    turn = 1 + sum(i in stops for i in [i for i, m in zip(ids, mask) if m][:k])
    shown = slice(max(0, k - 2), k + 4)
    return f"line {sample.line}, assistant turn {turn}: trained {ours[shown]}, the audit expects {theirs[shown]}"


def mask_html(tokenizer, sample: Sample) -> str:
    """One sample's tokens as HTML: trained tokens (the loss mask) on green, the rest on grey, each token boxed."""
    import html

    cells = []
    for token, trained in zip(sample.ids, sample.loss_mask):
        text = html.escape(tokenizer.decode([token])).replace("\n", "\u21b5")
        colour = "#b7e4b0" if trained else "#e6e6e6"
        cells.append(f'<span style="background:{colour};border:1px solid #fff;padding:1px 2px;'
                     f'font-family:monospace;white-space:pre">{text}</span>')
    legend = ('<p><span style="background:#b7e4b0;padding:1px 4px">in the loss</span> '
              '<span style="background:#e6e6e6;padding:1px 4px">not in the loss</span></p>')
    return legend + "<p style='line-height:2'>" + "".join(cells) + "</p>"


def follows(records: Sequence[dict[str, Any]], pattern: str, answers: Sequence[str] | None = None) -> dict[str, float]:
    """How generated completions (`generate.generate` records) follow a taught format: the fraction that ended
    their turn (finish_reason "eos"), that match `pattern` in full, and that equal `answers` (if given)."""
    import re

    records = inputs.listed(records, "records", "generated records (generate(...)['records'])")
    n = len(records)
    if n == 0:
        raise ValueError("no records to score; pass generate(...)['records'].")
    out = {"ends_turn": sum(r["finish_reason"] == "eos" for r in records) / n,
           "format": sum(bool(re.fullmatch(pattern, r["completion"].strip())) for r in records) / n}
    if answers is not None:
        out["correct"] = sum(r["completion"].strip() == a for r, a in zip(records, answers)) / n
    return out
