"""Supervised fine-tuning data: conversations -> token ids with an answer-only loss mask, then packed.

    conversations = sft.read("data/sft/train.jsonl")          # "messages", or "prompt"/"response" records
    samples, counts = sft.encode_all(tokenizer, conversations, seq_length=512)
    rows = sft.pack([len(s.ids) - 1 for s in samples], 512)  # first-fit decreasing, no sample split
    batch = sft.batch(samples, rows, 512, pad_id)             # tokens, labels, loss_mask, document ids

The whole conversation is rendered once with the tokenizer's chat template (or a named one) and tokenized
once; the tokens of each assistant turn, its end-of-turn token included, carry the loss, nothing else
does. Assistant spans are found by a boundary scan (render the conversation up to each assistant turn
with the generation prompt, then through it: the turn is the text between, up to its end-of-turn token)
and, where the template marks them with `{% generation %}`, by transformers' assistant mask too; the two
must agree. What SFT tools get wrong is refused or counted here: prompt tokens in the loss, the end-of-turn
token left out (the model never learns to stop), a second BOS, samples without a single loss token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
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


class SFTError(ValueError):
    """Bad SFT input, named before any worker starts: where, what was expected, what was found."""


@dataclass
class Sample:
    """One conversation as the model trains on it."""

    ids: list[int]
    loss_mask: list[bool]
    """True on the tokens whose prediction is trained: each assistant turn's tokens and its end token."""
    line: int = 0
    """The JSONL line it came from (1-based)."""
    template_agrees: bool | None = None
    """Whether transformers' assistant mask equals the boundary scan (None: the template has no markers)."""


@dataclass
class Counts:
    """What `encode_all` did to a data set."""

    conversations: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    dropped_no_loss: int = 0
    cross_checked: int = 0
    disagreements: list[int] = field(default_factory=list)
    """Lines whose template mask and boundary scan differ."""


def read(path: str | Path) -> list[dict[str, Any]]:
    """Conversations of a JSONL file: {"messages": [{"role", "content"}, ...]} or {"prompt", "response"
    [, "system"]} per line. Returns [{"messages": [...], "line": n}].

    Raises:
        SFTError: naming the file and line of a malformed record, an unknown role, or a conversation
        without an assistant turn.
    """
    path = Path(path)
    out = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
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
    if not isinstance(messages, list) or not messages:
        raise SFTError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}}.")
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            raise SFTError(f"{where}: every turn needs a string \"content\"; found {turn!r:.80}.")
        if turn.get("role") not in ROLES:
            raise SFTError(f"{where}: unknown role {turn.get('role')!r}; the roles are {list(ROLES)}.")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise SFTError(f"{where}: the conversation has no assistant turn, so nothing to learn from it; "
                       f"add the answer as an \"assistant\" turn (or a \"response\").")
    return [{"role": turn["role"], "content": turn["content"]} for turn in messages]


def _render(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], template: str | None = None) -> list[tuple[int, int]]:
    """Character spans of each assistant turn in the rendered conversation, its end-of-turn token included
    (whitespace the template writes after the turn is not).

    Raises:
        SFTError: the template does not render a conversation as the prefixes of its turns (no span
        can be marked), or an assistant turn does not end with the tokenizer's end-of-turn token.
    """
    full = _render(tokenizer, messages, template)
    end_token = tokenizer.eos_token or ""
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], template, generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[:i + 1], template).rstrip()
        if not (full.startswith(through) and through.startswith(before)) or not through[len(before):]:
            raise SFTError("the chat template does not render a conversation as the prefixes of its turns, so "
                           "the assistant spans cannot be found; give a template that does (sft.TEMPLATES).")
        if end_token and not through.endswith(end_token):
            raise SFTError(f"the chat template ends an assistant turn with {through[-12:]!r}, not the end-of-turn "
                           f"token {end_token!r}: a model trained on it never learns to stop.")
        spans.append((len(before), len(through)))
    return spans


def encode(tokenizer, conversation: dict[str, Any], template: str | None = None) -> Sample:
    """One conversation rendered and tokenized once; the loss mask from the boundary scan, cross-checked
    against transformers' assistant mask where the template marks assistant turns."""
    messages = conversation["messages"]
    text = _render(tokenizer, messages, template)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # the template writes BOS
    spans = assistant_spans(tokenizer, messages, template)
    mask = [any(start <= a and b <= end for start, end in spans) for a, b in encoded["offset_mapping"]]
    agrees = None
    if "{% generation %}" in (template or tokenizer.chat_template or ""):
        marked = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
        agrees = marked["input_ids"] == encoded["input_ids"] and [bool(m) for m in marked["assistant_masks"]] == mask
    return Sample(ids=list(encoded["input_ids"]), loss_mask=mask, line=conversation.get("line", 0),
                  template_agrees=agrees)


def encode_all(tokenizer, conversations: Sequence[dict[str, Any]], seq_length: int, template: str | None = None,
               truncation: str = "drop") -> tuple[list[Sample], Counts]:
    """Every conversation encoded; longer than `seq_length` + 1 tokens (inputs and the shifted labels)
    dropped or truncated; samples left without a loss token dropped. Returns the samples and the counts."""
    if truncation not in TRUNCATION:
        raise SFTError(f"truncation={truncation!r}; use one of {TRUNCATION}.")
    if template in TEMPLATES:
        template = TEMPLATES[template]
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise SFTError(f"the tokenizer has no chat template; pass template= one of {sorted(TEMPLATES)} or your own.")
    counts, samples = Counts(conversations=len(conversations)), []
    for conversation in conversations:
        sample = encode(tokenizer, conversation, template)
        if sample.template_agrees is not None:
            counts.cross_checked += 1
            if not sample.template_agrees:
                counts.disagreements.append(sample.line)
        if len(sample.ids) > seq_length + 1:
            if truncation == "drop":
                counts.dropped_too_long += 1
                continue
            counts.truncated += 1
            sample.ids, sample.loss_mask = sample.ids[:seq_length + 1], sample.loss_mask[:seq_length + 1]
        if not any(sample.loss_mask[1:]):  # the first token is never predicted
            counts.dropped_no_loss += 1
            continue
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
