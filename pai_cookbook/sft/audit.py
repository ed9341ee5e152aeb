"""Looking at the data and at what the model learnt: every loss mask checked token by token against a second,
independent placing of the answers; one conversation's tokens coloured by mask; how completions follow a format."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pai_cookbook import chat_template as chat
from pai_cookbook.core.launching import inputs
from pai_cookbook.core.text.sft_data import SFTError
from pai_cookbook.sft.records import Sample, template_text


# --------------------------------------------------------------------------------------------------
# Looking at the data and at what the model learnt
# --------------------------------------------------------------------------------------------------
def audit(tokenizer, samples: Sequence[Sample], conversations: Sequence[dict[str, Any]], template: str | None = None,
          *, stop_ids: list[int] | None = None, system: str = "keep", special_text: str = "refuse") -> dict[str, Any]:
    """What the loss masks train, checked token by token against a second, independent placing of the answers: the
    conversation is rendered and tokenized again, each answer found by searching its text forward from the message
    before, and each generation prompt (what `add_generation_prompt=True` adds) searched before it. A turn's trained
    tokens must be exactly those from the end of its generation prompt (the answer's first token when the prompt is
    not there) through the first stop token after the answer, however the boundaries merge; nothing else is trained,
    and no sample starts with two BOS tokens. A mismatch names the line, the turn and the tokens on both sides.
    With `special_text="as_text"` special-token text inside the messages found is read as plain text, as `encode`
    reads it."""
    by_line = {c["line"]: c for c in conversations}
    if len(by_line) != len(conversations):
        raise SFTError("conversations share line numbers; give each a distinct \"line\" (or none: sft.prepare numbers them).")
    unknown = sorted({s.line for s in samples} - set(by_line))
    if unknown:
        raise SFTError(f"samples of lines {unknown[:10]} have no conversation among those given (lines "
                       f"{sorted(by_line)[:10]}); pass the conversations the samples were encoded from.")
    template = template_text(template)
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
        expected, turns = _expected_mask(tokenizer, messages, template, stops, special_text == "as_text")
        out["assistant_turns"] += turns
        out["stop_tokens_trained"] += sum(m and i in stops for i, m in zip(sample.ids, sample.loss_mask))
        if expected is None or expected[0] != sample.ids or expected[1] != sample.loss_mask:
            out["mismatched_samples"] += 1
            out["mismatched_lines"].append(sample.line)
            if len(out["mismatches"]) < 5:
                out["mismatches"].append(_difference(tokenizer, sample, expected, stops))
    return out


def _expected_mask(tokenizer, messages: list[dict], template: str | None, stops: list[int], as_text: bool = False):
    """(ids, mask) by the audit's own placing (`audit`), and the number of assistant turns; (None, n) when an
    answer or its stop token is not found."""
    text = chat.render(tokenizer, messages, template)
    starts = _starts(tokenizer, messages, template, text)
    spans, pos = [], 0
    for i, message in enumerate(messages if as_text else []):  # each message's text found as the answers are below
        core = message["content"].strip()
        at = text.find(core, pos if starts[i] is None else starts[i]) if core else -1
        if at >= 0:
            spans.append((at, at + len(core)))
            pos = at + len(core) if message["role"] != "system" else pos
    ids, offsets, _ = chat.tokenize(tokenizer, text, spans, set(tokenizer.all_special_ids) | set(stops), as_text)
    mask, turns, pos = [False] * len(ids), 0, 0
    for i, message in enumerate(messages):
        core = message["content"].strip()
        at = text.find(core, pos if starts[i] is None else starts[i])
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


def _starts(tokenizer, messages: list[dict], template: str | None, text: str) -> list[int | None]:
    """Where each message's text can start in `text`, the rendering: the first character at which two renderings
    with that message's content replaced by two different characters differ (the template's text before it is the
    same), where `text` has the same text before it; None where it has not (a template whose earlier text depends on
    this message's content), and the forward search alone places the message. A message whose text the template
    also writes before it (`<|im_end|>` typed alone) is then found in its place, not in the template's."""
    out = []
    for i, message in enumerate(messages):
        a, b = (chat.render(tokenizer, messages[:i] + [message | {"content": c}] + messages[i + 1:], template)
                for c in ("\ue000", "\ue001"))
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        out.append(at if at is not None and text[:at] == a[:at] else None)
    return out


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


def follows(records: Sequence[dict[str, Any]], pattern: str, answers: Sequence[str] | None = None,
            numbers: Sequence[int | float | str] | None = None) -> dict[str, float]:
    """How generated completions (`generate.generate` records) follow a taught format: the fraction that ended
    their turn (finish_reason "eos"), that match `pattern` in full, that equal `answers` (if given: the format and the
    right content at once), and (with `numbers`) whose last number is the expected one, whatever the words around it:
    the arithmetic apart from the format ("50 + 39 = 89." and "The answer is 89." both count)."""
    import re

    records = inputs.listed(records, "records", "generated records (generate(...)['records'])")
    n = len(records)
    if n == 0:
        raise ValueError("no records to score; pass generate(...)['records'].")
    out = {"ends_turn": sum(r["finish_reason"] == "eos" for r in records) / n,
           "format": sum(bool(re.fullmatch(pattern, r["completion"].strip())) for r in records) / n}
    if answers is not None:
        out["correct"] = sum(r["completion"].strip() == a for r, a in zip(records, answers)) / n
    if numbers is not None:
        last = [(re.findall(r"-?\d+(?:\.\d+)?", r["completion"].replace(",", "")) or [None])[-1] for r in records]
        out["right_number"] = sum(x is not None and float(x) == float(v) for x, v in zip(last, numbers)) / n
    return out
