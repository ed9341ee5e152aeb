"""Conversations as the model trains on them: records read and checked, rendered once with a chat template and
tokenized once, each assistant turn (from the end of its generation prompt through its stop token) carrying the
loss (`chat_template` places the messages and refuses what cannot be trained right)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pai_cookbook import chat_template as chat
from pai_cookbook.core.launching import inputs
from pai_cookbook.core.text.sft_data import SFTError

ROLES = ("system", "user", "assistant")
DEFAULT_SET = Path(__file__).resolve().parents[2] / "data" / "sft" / "arithmetic.jsonl"
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
    special_as_text: bool = False
    """A message typed a special token's text, encoded as plain text (`special_text="as_text"`)."""


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
    special_as_text: list[int] = field(default_factory=list)
    """Lines whose typed special-token text was encoded as plain text (`special_text="as_text"`)."""


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
        out.append({"messages": checked_messages(record, where), "line": number})
    if not out:
        raise SFTError(f"{path} holds no conversations; write one JSON object per line.")
    return out


def checked_messages(record: Any, where: str) -> list[dict[str, str]]:
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


def template_text(template: str | None) -> str | None:
    """A template as its Jinja text (`read_template`: a name of TEMPLATES, a file, a folder or Jinja text; anything
    else is refused); None: the tokenizer's own."""
    spec = read_template(template)
    return TEMPLATES.get(spec, spec) if spec is not None else None


def _where(conversation: dict[str, Any]) -> str:
    return conversation.get("where") or f"line {conversation.get('line', 0)}"


def encode(tokenizer, conversation: dict[str, Any], template: str | None = None, *, stop_ids: list[int] | None = None,
           system: str = "keep", check_generation_prompt: bool = True, special_text: str = "refuse") -> Sample:
    """One conversation rendered and tokenized once, with its answer-only loss mask (`chat_template`: each assistant
    turn from the end of its generation prompt through its stop token), cross-checked against transformers'
    assistant mask where the template marks assistant turns with `{% generation %}`.

    Args:
        stop_ids: the ids that end a turn; default `chat_template.stop_ids(tokenizer)`: the generation config's eos
            ids in the folder the tokenizer was loaded from, and the tokenizer's eos.
        system: "keep", or "fold" the system message into the first user turn (templates without a system role).
        check_generation_prompt: refuse a template whose generation prompt is not what it writes before an answer.
        special_text: "refuse" a message that types a special token's text (`<|im_end|>`, `</s>`), or encode it
            "as_text": the plain text's tokens (`chat_template.tokenize`; transformers' mask is then not compared,
            as its ids read the text as the control token).
    Raises:
        SFTError: naming the conversation's line and the way through (`chat_template`'s refusals).
    """
    if system not in chat.SYSTEM:
        raise SFTError(f"system={system!r}; use one of {chat.SYSTEM}.")
    if not isinstance(conversation, dict) or "messages" not in conversation:
        raise SFTError(f"expected a conversation {{\"messages\": [...]}} (as sft.read gives), found "
                       f"{conversation!r:.80}; read records with sft.read(...) first.")
    where = _where(conversation)
    messages, template = checked_messages(conversation, where), template_text(template)
    if system == "fold":
        messages = chat.fold_system(messages)
    stops = stop_ids if stop_ids is not None else chat.stop_ids(tokenizer)
    located = chat.locate(tokenizer, messages, template, where, check_generation_prompt)
    ids, mask, as_text = chat.mask(tokenizer, located, stops, where, special_text)
    agrees = None
    if "{% generation %}" in (template or tokenizer.chat_template or "") and not as_text:
        marked = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
        agrees = marked["input_ids"] == ids and [bool(m) for m in marked["assistant_masks"]] == mask
    return Sample(ids=ids, loss_mask=mask, line=conversation.get("line", 0), template_agrees=agrees,
                  special_as_text=as_text)


def encode_all(tokenizer, conversations: Sequence[dict[str, Any]], seq_length: int, template: str | None = None,
               truncation: str = "drop", **options: Any) -> tuple[list[Sample], Counts]:
    """Every conversation encoded (`options`: `encode`'s); longer than `seq_length` + 1 tokens (inputs and the
    shifted labels) dropped or truncated; samples left without a loss token dropped. Returns the samples and the
    counts: every conversation is kept (truncated or not), dropped too long, or dropped without a loss token."""
    if truncation not in TRUNCATION:
        raise SFTError(f"truncation={truncation!r}; use one of {TRUNCATION}.")
    template = template_text(template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise SFTError(f"the tokenizer has no chat template; pass template= one of {sorted(TEMPLATES)} or your own.")
    counts, samples = Counts(conversations=len(conversations)), []
    for conversation in conversations:
        sample = encode(tokenizer, conversation, template, **options)
        if sample.special_as_text:
            counts.special_as_text.append(sample.line)
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


