"""Which tokens of a chat-templated conversation a model learns to generate: the answer-only loss mask.

    turns = chat_template.locate(tokenizer, messages, template, where="data.jsonl:3")
    ids, mask, _ = chat_template.mask(tokenizer, turns, stop_ids, where="data.jsonl:3")

The conversation is rendered once with the template, as the model will see it, and tokenized once. Each message's
text is then placed in the rendered string by rendering the same conversation with a marker in place of every
message (the markers' positions split the template's own text from the messages'); the real rendering must be that
text with each message in its place, as written or trimmed (Llama 3's and Gemma's templates trim). An assistant turn
is trained from the end of its generation prompt (what `add_generation_prompt=True` renders after the turns before
it: the model generates everything after that, a fixed block such as Qwen3's empty `<think>` included) through the
first stop token after the answer (the model's `generation_config.json` eos ids and the tokenizer's eos: Llama 3's
`<|eot_id|>`, Gemma's `<end_of_turn>`). A token that the answer's first or last character merges into is trained:
it is what the model must produce there.

Refused, naming the conversation and the way through: a template that refuses the conversation (a system role it
does not support: `system="fold"`), an assistant turn with no stop token after it (`stop_tokens=`), a generation
prompt other than what the template writes before an answer in training (a thinking prompt:
`check_generation_prompt=False`), a template that rewrites a message, and special-token text typed inside a message
(it would be read as the control token: a stop token inside an answer teaches the model to stop there; an HTML `</s>`
or a chat log quoting `<|im_end|>` is plain text to its writer: `special_text="as_text"` encodes it so, as this
tokenizer splits that text with the words around it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pai_cookbook.core.launching import inputs
from pai_cookbook.core.text.sft_data import SFTError

MARK = "\ue000{}\ue001"
"""A message's stand-in while the template's own text is located (private-use characters no template writes)."""
TRANSFORMS = (lambda s: s, str.strip, str.lstrip, str.rstrip, lambda s: s.strip("\n"), lambda s: s.lstrip("\n"),
              lambda s: s.rstrip("\n"))
"""How templates write a message: as given, or trimmed (Llama 3 and Gemma trim; Qwen3 drops leading newlines)."""
SYSTEM = ("keep", "fold")


@dataclass
class Turn:
    """One assistant turn's place in the rendered conversation (character offsets)."""

    index: int
    """The message's index in the conversation."""
    train_start: int
    """Where the text the model generates starts: the end of the generation prompt."""
    answer_start: int
    answer_end: int


@dataclass
class Located:
    """A conversation rendered, with every message's text placed in it."""

    text: str
    spans: dict[int, tuple[int, int]]
    """Message index -> (start, end) of its text in `text` (messages the template does not render are absent)."""
    turns: list[Turn]


def stop_ids(tokenizer, folder: str | Path | None = None, names: list[str] | None = None) -> list[int]:
    """The ids that end an assistant turn: the tokens `names` (`stop_tokens=`) when given, else the model's
    `generation_config.json` eos ids in `folder` (default: the folder the tokenizer was loaded from; Llama 3 and Gemma
    list their turn ends there) and the tokenizer's eos.

    Raises:
        SFTError: a name that is not one token of the vocabulary.
    """
    if names:
        ids = []
        for name in inputs.listed(names, "stop_tokens", "token strings", error=SFTError):
            found = tokenizer.convert_tokens_to_ids(name)
            if found is None or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != name:
                raise SFTError(f"stop_tokens names {name!r}, which is not a token of this vocabulary; name the token "
                               f"that ends an assistant turn as the template writes it (e.g. '<|eot_id|>').")
            ids.append(found)
        return ids
    from pai_cookbook.core.text import tokenizer as tokenizers

    if folder is None and Path(str(getattr(tokenizer, "name_or_path", "") or "-")).is_dir():
        folder = tokenizer.name_or_path  # the folder the tokenizer was loaded from: a model's or a checkpoint's
    ids = tokenizers.eos_ids(folder, tokenizer) if folder is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def read(spec: str | Path | None, names: dict[str, str] | None = None) -> str | None:
    """A chat template as a parameter names it: empty or None (the tokenizer's own: None), a name of `names`
    (returned as is), a .jinja file, a Hugging Face model or tokenizer folder (its chat_template.jinja, else
    tokenizer_config.json's), or Jinja text.

    Raises:
        SFTError: a folder without a template, or a string that is none of these.
    """
    if not spec:
        return None
    if names and spec in names:
        return str(spec)
    path = Path(spec)
    if "{{" in str(spec) or "{%" in str(spec):
        return str(spec)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if path.is_dir():
        if (path / "chat_template.jinja").exists():
            return (path / "chat_template.jinja").read_text(encoding="utf-8")
        config = path / "tokenizer_config.json"
        found = inputs.read_json(config, fix="Download the model's tokenizer files again.",
                                 error=SFTError).get("chat_template") if config.exists() else None
        if isinstance(found, str):
            return found
        raise SFTError(f"{path} holds no chat template (chat_template.jinja, or a chat_template in "
                       f"tokenizer_config.json); name a model folder that has one, or a .jinja file.")
    raise SFTError(f"chat template {str(spec)[:80]!r} is not a file, a folder, Jinja text or one of "
                   f"{sorted(names or [])}.")


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation with a leading system message folded into the first user turn ("system\\n\\nuser"), for
    templates without a system role (Gemma)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    if system.strip():
        first = next(i for i, m in enumerate(rest) if m["role"] == "user")
        rest[first]["content"] = f"{system}\n\n{rest[first]['content']}"
    return rest


def render(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool = False,
           where: str = "") -> str:
    """The conversation as the template writes it; the template's own refusals as an SFTError naming `where`."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as err:
        way = (" Fold the system message into the first user turn with system='fold'."
               if "system" in str(err).lower() and any(m["role"] == "system" for m in messages) else
               " Give a conversation the template accepts, or another template (template=...).")
        raise SFTError(f"{where}: the chat template refuses this conversation: {err}.{way}") from None


def _marked(messages: list[dict]) -> list[dict]:
    """The conversation with a marker for each message; an empty prompt message stays empty (templates drop an
    empty system message, Phi-3.5's, or write their default in its place, SmolLM3's): it has no text to place."""
    return [m if not m["content"] and m["role"] != "assistant" else m | {"content": MARK.format(i)}
            for i, m in enumerate(messages)]


def _marks(text: str, count: int, where: str) -> list[tuple[int, int]]:
    """(position, message index) of each marker in `text`, in text order."""
    found = []
    for i in range(count):
        at = text.find(MARK.format(i))
        if at >= 0 and text.find(MARK.format(i), at + 1) >= 0:
            raise SFTError(f"{where}: the chat template writes message {i} twice; the cookbook cannot tell which "
                           f"copy to train. Give another template (template=...).")
        if at >= 0:
            found.append((at, i))
    return sorted(found)


def locate(tokenizer, messages: list[dict], template: str | None, where: str = "",
           check_generation_prompt: bool = True) -> Located:
    """The rendered conversation and each message's place in it; for every assistant turn, where the text the model
    generates starts (module doc).

    Raises:
        SFTError: naming `where`: the template refuses the conversation, drops or rewrites an assistant turn, or
        (with `check_generation_prompt`) prompts for an answer with other text than it writes before one.
    """
    text = render(tokenizer, messages, template, where=where)
    skeleton = render(tokenizer, _marked(messages), template, where=where)
    marks = _marks(skeleton, len(messages), where)
    missing = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i not in {k for _, k in marks}]
    if missing:
        raise SFTError(f"{where}: the chat template does not write assistant turn {missing[0]} as given (it drops or "
                       f"rewrites it), so it cannot be trained; give another template (template=...).")
    ends = [at for at, _ in marks] + [len(skeleton)]
    segments = [skeleton[:ends[0]]] + [skeleton[at + len(MARK.format(i)):ends[k + 1]]
                                       for k, (at, i) in enumerate(marks)]
    if not text.startswith(segments[0]):
        raise SFTError(f"{where}: the chat template writes other text before the first message than it does for "
                       f"the same conversation's structure ({segments[0][-40:]!r}); give another template.")
    spans, pos = {}, len(segments[0])
    for k, (_, i) in enumerate(marks):
        content, after = messages[i]["content"], segments[k + 1]
        for transform in TRANSFORMS:
            written = transform(content)
            if text.startswith(written, pos) and text.startswith(after, pos + len(written)) and (
                    k + 1 < len(marks) or pos + len(written) + len(after) == len(text)):
                spans[i] = (pos, pos + len(written))
                pos += len(written) + len(after)
                break
        else:
            raise SFTError(f"{where}: the chat template rewrites the {messages[i]['role']} message {i} ({content[:40]!r}"
                           f"), so its tokens cannot be placed; the cookbook trains what a template writes for a "
                           f"message as given or trimmed. Give the message as the template writes it, or another "
                           f"template.")
    turns = []
    for k, (_, i) in enumerate(marks):
        if messages[i]["role"] != "assistant":
            continue
        before = segments[k]  # the template's text between the previous message and this answer
        prompt = render(tokenizer, _marked(messages[:i]), template, generation_prompt=True, where=where)
        last = _marks(prompt, i, where)
        tail = prompt[last[-1][0] + len(MARK.format(last[-1][1])):] if last else prompt
        start = spans[i][0]
        if before.startswith(tail):
            start -= len(before) - len(tail)  # a block the model generates before the answer (Qwen3's <think></think>)
        elif check_generation_prompt:
            raise SFTError(f"{where}: the generation prompt ends with {tail[-40:]!r}, but before assistant message {i} "
                           f"the template writes {before[-40:]!r}: a model trained on it meets another prompt when it "
                           f"generates (a thinking prompt, say). Give a template whose generation prompt is what it "
                           f"writes before an answer, or train on the answers as written with "
                           f"check_generation_prompt=False.")
        turns.append(Turn(index=i, train_start=start, answer_start=spans[i][0], answer_end=spans[i][1]))
    return Located(text=text, spans=spans, turns=turns)


def overlaps(token: tuple[int, int], start: int, end: int) -> bool:
    """Whether a token's character span (an empty one: its position) falls in [start, end)."""
    a, b = token
    return start <= a < end if a == b else max(a, start) < min(b, end)


SPECIAL_TEXT = ("refuse", "as_text")
"""What to do with special-token text typed inside a message: refuse the conversation, or encode it as the plain text
it is (`tokenize`)."""


def tokenize(tokenizer, text: str, spans: list[tuple[int, int]], control: set[int], as_text: bool
             ) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """`text` tokenized once (the template writes BOS): (ids, character offsets, the indices of control tokens typed
    inside `spans`, the messages, in that one tokenization). With `as_text` a conversation that types one is
    tokenized once more, by the same tokenizer with only the template's occurrences of those tokens recognised
    (`_plain_typed`): the typed text is then the plain text it is to this tokenizer, merged with the words and spaces
    around it as any text is, and everything else tokenized as before; the ids and offsets are then that second
    tokenization's, and the indices still those of the first."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    typed = _control_in(ids, offsets, control, spans)
    if not as_text or not typed:
        return ids, offsets, typed
    out_ids, out_offsets = _plain_typed(tokenizer, text, ids, offsets, typed)
    inside = _control_in(out_ids, out_offsets, control, spans)
    if inside:
        a, b = out_offsets[inside[0]]
        raise SFTError(f"{text[a:b]!r} cannot be encoded as the plain text it is by this tokenizer (its plain-text "
                       f"tokenization is the control token {out_ids[inside[0]]} again); remove or reword it in the "
                       f"data.")
    return out_ids, out_offsets, typed


def _control_in(ids: list[int], offsets: list[tuple[int, int]], control: set[int], spans: list[tuple[int, int]]
                ) -> list[int]:
    """The indices of control tokens whose text lies inside one of `spans` (typed in a message)."""
    return [k for k, (a, b) in enumerate(offsets)
            if ids[k] in control and a < b and any(start <= a and b <= end for start, end in spans)]


SENTINEL = "\ue002{}\ue003"
"""What the template's own occurrence of a typed control token is written as for `_plain_typed` (private-use
characters, which no template or vocabulary writes)."""


def _plain_typed(tokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]], typed: list[int]
                 ) -> tuple[list[int], list[tuple[int, int]]]:
    """`text` tokenized by a copy of `tokenizer` in which the control tokens typed at `typed` are known by other
    texts (`SENTINEL`, with the same id and flags): the template's occurrences of them are rewritten to those texts
    and stay the control tokens, the typed ones are no added token's text any more and are tokenized as plain text,
    in one pass. Offsets are mapped back to `text`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise SFTError(f"special_text=\"as_text\" needs a fast (Rust-backed) tokenizer; {type(tokenizer).__name__} "
                       f"is not one. Load the model's tokenizer.json with transformers, or remove the typed text.")
    renamed = frozenset(ids[k] for k in typed)
    made = tokenizer.__dict__.setdefault("_pai_cookbook_plain_typed", {})
    if renamed not in made:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        for added in spec.get("added_tokens", []):
            if added["id"] in renamed:
                added["content"] = SENTINEL.format(added["id"])
        plain = Tokenizer.from_str(json.dumps(spec))
        # rebuilt, an added token takes the id its text has in the model's vocabulary, or the next free one: its own
        # id again (a renamed token's old text stays in a vocabulary that holds it)
        own = {plain.token_to_id(added["content"]): added["id"] for added in spec.get("added_tokens", [])}
        made[renamed] = plain, {k: v for k, v in own.items() if k != v}
    plain, own = made[renamed]
    typed_at = set(typed)
    pieces, edits, last, length = [], [], 0, 0  # edits: (start in the rewritten text, its end, start in text, end)
    for k, (a, b) in enumerate(offsets):
        if ids[k] in renamed and k not in typed_at and a < b:
            sentinel = SENTINEL.format(ids[k])
            pieces += [text[last:a], sentinel]
            start = length + a - last
            length = start + len(sentinel)
            edits.append((start, length, a, b))
            last = b
    pieces.append(text[last:])
    encoded = plain.encode("".join(pieces), add_special_tokens=False)

    def back(x: int) -> int:  # a position in the rewritten text, in `text`
        shift = 0
        for start, stop, a, b in edits:
            if x <= start:
                break
            if x < stop:
                return a
            shift = b - stop
        return x + shift

    return [own.get(i, i) for i in encoded.ids], [(back(a), back(b)) for a, b in encoded.offsets]


def mask(tokenizer, located: Located, stops: list[int], where: str = "", special_text: str = "refuse"
         ) -> tuple[list[int], list[bool], bool]:
    """Token ids of the rendered conversation (`tokenize`), the loss mask (each assistant turn from its
    `train_start` through the first stop token after the answer), and whether special-token text typed in a message
    was encoded as plain text.

    Args:
        special_text: "refuse" a message that types a special token's text, or encode it "as_text" (`tokenize`).
    Raises:
        SFTError: naming `where`: an assistant turn with no stop token before the next message, or (by default)
        special-token text typed inside a message.
    """
    if special_text not in SPECIAL_TEXT:
        raise SFTError(f"special_text={special_text!r}; use one of {SPECIAL_TEXT}.")
    control = set(tokenizer.all_special_ids) | set(stops)
    as_text = special_text == "as_text"
    ids, offsets, typed = tokenize(tokenizer, located.text, list(located.spans.values()), control, as_text)
    if typed and not as_text:
        token = located.text[offsets[typed[0]][0]:offsets[typed[0]][1]]
        i = next(i for i, (start, end) in located.spans.items() if start <= offsets[typed[0]][0] < end)
        raise SFTError(f"{where}: message {i} types {token!r}, the text of the special token {ids[typed[0]]}: "
                       f"inside a message it would be read as that control token (a stop token inside an answer "
                       f"teaches the model to stop there). Remove or reword it in the data, or encode such text as "
                       f"the plain text it is with special_text=\"as_text\".")
    keep = [False] * len(ids)
    starts = sorted(start for start, _ in located.spans.values())
    for turn in located.turns:
        following = next((s for s in starts if s > turn.answer_start), len(located.text))
        stop = next((k for k, (a, b) in enumerate(offsets) if ids[k] in stops and b > turn.answer_end
                     and a >= turn.answer_end and a < following), None)
        if stop is None:
            names = [tokenizer.convert_ids_to_tokens(s) for s in stops]
            shown = located.text[turn.answer_end:following][:40]
            raise SFTError(f"{where}: the chat template ends assistant message {turn.index} with {shown!r}, and none of "
                           f"the stop tokens {names} follows before the next message: a model trained on it never "
                           f"learns to stop. Name the token that ends a turn with stop_tokens=[...] (the model's "
                           f"generation_config.json lists its stop tokens as eos_token_id).")
        end = offsets[stop][1]
        for k, o in enumerate(offsets):
            if overlaps(o, turn.train_start, end):
                keep[k] = True
    return ids, keep, bool(typed)
