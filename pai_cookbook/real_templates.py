"""Real chat templates on real vocabularies: fetched once with pip, cached, never vendored (notebook 06 and the
SFT tests run `sft.prepare` on each).

    folder = real_templates.tokenizer_folder(real_templates.MATRIX[0])  # tokenizer files, chat_template.jinja,
    tokenizer = AutoTokenizer.from_pretrained(folder)                    # generation_config.json where the model has one
    rows = real_templates.survey(conversations, "runs/survey", seq_length=2048)  # each template: prepared or refused

The `llama-cpp-python` 0.3.36 sdist (PyPI, MIT, 76.6 MB) carries llama.cpp's test assets: the chat templates of
released models (`vendor/llama.cpp/models/templates/*.jinja`, copied from their Hugging Face repositories) and
vocabulary-only GGUF files (`models/ggml-vocab-*.gguf`: Llama 3's byte-level BPE, Llama 2's SentencePiece, Qwen2's,
Phi-3's, ...). `fetch` downloads the sdist with pip and keeps only those files; `tokenizer_folder` turns a vocabulary
into a Hugging Face tokenizer folder with transformers' GGUF reader and pairs it with a template (`MATRIX`), once.

A pairing is a released model's template on the vocabulary its tokenizer is built on. Where the template writes
special tokens that this vocabulary lacks and the released tokenizer has (DeepSeek-R1-Distill's `<｜Assistant｜>` on
Qwen2's vocabulary), they are added as added tokens, special as in the release; their ids follow the vocabulary's
(the release reuses reserved ids), which changes no mask. Where the released model's `generation_config.json` lists
the tokens that end a turn, that file is written with those ids, each checked against the vocabulary by name. The
pairings that cannot be made from these files are in `NOT_BUILT` with the reason.

    python -m pai_cookbook.real_templates     # fetch, build every folder, print the seconds it took
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pai_cookbook import smollm2
from pai_cookbook.core.progress import quiet_transformers

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
PIP_COMMAND = (f"python -m pip download {PACKAGE}=={VERSION} --no-deps --no-binary :all: -d DIR")
MODELS = "*/vendor/llama.cpp/models/"
VOCABS = ("llama-bpe", "llama-spm", "qwen2", "phi-3", "deepseek-llm", "gemma-4", "starcoder")
"""The vocabularies the matrix uses (ggml-vocab-<name>.gguf): 37 MB of the sdist's 74 MB of vocabulary files."""
SMOLLM2 = "smollm2"
"""`Case.vocab` of SmolLM2-135M-Instruct's own tokenizer and template (`smollm2.hf_folder`), not a GGUF file."""
SOURCE_FILE = "real_templates.json"
"""Written last into a finished folder (the fetched files, each tokenizer folder): what it was made from."""


class FetchError(RuntimeError):
    """The sdist could not be fetched with pip; the message gives the command to run by hand."""


@dataclass(frozen=True)
class Case:
    """One released model's chat template on the vocabulary its tokenizer is built on."""

    id: str
    template: str | None
    """File stem under templates/; None: the tokenizer's own (SmolLM2)."""
    vocab: str
    """ggml-vocab-<vocab>.gguf, or SMOLLM2."""
    turn_end: str
    """The token the template ends an assistant turn with (what `stop_tokens=` names when nothing else does)."""
    special: tuple[str, ...] = ()
    """Special tokens the template writes, the released tokenizer has and this vocabulary lacks: added."""
    plain: tuple[str, ...] = ()
    """Added tokens the release has as non-special (`<think>`): added as such."""
    bos: str | None = None
    eos: str | None = None
    """bos/eos as the released tokenizer_config.json sets them, where they are tokens added here; None: the
    vocabulary's own."""
    generation_eos: tuple[tuple[int, str], ...] = ()
    """The released generation_config.json's eos_token_id, each id with the token it must be in this vocabulary
    (checked when the folder is built)."""
    note: str = ""


# The sdist's llama-bpe is Llama 3's vocabulary; Llama 3.1 renamed slot 128008 <|eom_id|> (the end of a tool-call
# turn, which these conversations do not have): the same id, named as this vocabulary names it.
LLAMA3_EOS = ((128001, "<|end_of_text|>"), (128008, "<|reserved_special_token_4|>"), (128009, "<|eot_id|>"))
QWEN_EOS = ((151645, "<|im_end|>"), (151643, "<|endoftext|>"))
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
THINK = ("<think>", "</think>")

MATRIX: list[Case] = [
    Case("llama-3.1", "meta-llama-Llama-3.1-8B-Instruct", "llama-bpe", "<|eot_id|>", generation_eos=LLAMA3_EOS,
         note="eos <|end_of_text|> (the vocabulary's); turns end with <|eot_id|>, which generation_config lists"),
    Case("llama-3.1-tokenizer-only", "meta-llama-Llama-3.1-8B-Instruct", "llama-bpe", "<|eot_id|>",
         note="the tokenizer files without the model's generation_config.json: nothing says <|eot_id|> ends a turn"),
    Case("llama-3.2", "meta-llama-Llama-3.2-3B-Instruct", "llama-bpe", "<|eot_id|>", generation_eos=LLAMA3_EOS,
         note="writes today's date (strftime_now) into the system header"),
    Case("qwen2.5", "Qwen-Qwen2.5-7B-Instruct", "qwen2", "<|im_end|>", generation_eos=QWEN_EOS,
         note="a default system message when none is given"),
    Case("qwen3", "Qwen-Qwen3-0.6B", "qwen2", "<|im_end|>", plain=THINK, generation_eos=QWEN_EOS,
         note="an empty <think></think> block before the last answer only"),
    # The released R1-Distill-Qwen tokenizer renames ids 151643-151649 to these (<think> and </think> non-special);
    # its generation_config.json lists one eos, <｜end▁of▁sentence｜>, which is the tokenizer's eos here too.
    Case("r1-distill-qwen", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "qwen2", "<｜end▁of▁sentence｜>",
         special=DEEPSEEK, plain=THINK, bos=DEEPSEEK[0], eos=DEEPSEEK[1],
         note="generation prompt <｜Assistant｜><think>\\n</think> (<think>\\n with enable_thinking); answers are "
              "rendered after <｜Assistant｜> alone"),
    Case("phi-3.5", "microsoft-Phi-3.5-mini-instruct", "phi-3", "<|end|>",
         generation_eos=((32007, "<|end|>"), (32001, "<|assistant|>"), (32000, "<|endoftext|>")),
         note="SentencePiece; eos <|endoftext|> after the last turn, turns end with <|end|>"),
    Case("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407", "llama-spm", "</s>",
         note="Llama 2's SentencePiece: [INST] is text here (control tokens in Nemo's Tekken vocabulary, "
              "not in the sdist); the system message goes into the last user turn"),
    Case("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506", "llama-spm", "</s>",
         note="[INST]/[SYSTEM_PROMPT] as text on Llama 2's SentencePiece; a long dated default system prompt"),
    Case("gemma-4", "google-gemma-4-31B-it", "gemma-4", "<turn|>",
         note="Gemma 4's own vocabulary; eos <eos>, turns end with <turn|>; no generation_config.json written "
              "(its eos ids are not checked here); the generation prompt adds an empty thought channel"),
    # The DeepSeek-V3 vocabulary (129,280 tokens) is not in the sdist; DeepSeek-LLM's (102,400) has its bos/eos.
    # transformers' GGUF reader gives those two new ids (102401, 102402) after the 102,400 the vocabulary holds.
    Case("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1", "deepseek-llm", "<｜end▁of▁sentence｜>",
         special=DEEPSEEK[2:], plain=THINK,
         note="V3.1's template on DeepSeek-LLM's vocabulary; <think></think> before every answer"),
    # SmolLM3's tokenizer is Llama 3.2's with <|im_start|>/<|im_end|> in reserved slots; eos <|im_end|>.
    Case("smollm3", "HuggingFaceTB-SmolLM3-3B", "llama-bpe", "<|im_end|>", special=("<|im_start|>", "<|im_end|>"),
         eos="<|im_end|>", note="ChatML on Llama 3's vocabulary; a long default system prompt; lstrips '\\n'"),
    # Granite 3's vocabulary is StarCoder's 49,152 tokens, id 0 renamed <|end_of_text|>, three role tokens added.
    Case("granite-3.3", "ibm-granite-granite-3.3-2B-Instruct", "starcoder", "<|end_of_text|>",
         special=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"), eos="<|end_of_text|>",
         note="StarCoder's vocabulary; a dated default system message"),
    Case("smollm2", None, SMOLLM2, "<|im_end|>", note="SmolLM2-135M-Instruct's own tokenizer and template"),
]

NOT_BUILT = {
    "gemma-2": "no Gemma 2 vocabulary in the sdist; Gemma 4's has no <start_of_turn>/<end_of_turn> (it uses "
               "<|turn>/<turn|>; its id 107 is '\\n', not Gemma 2's <end_of_turn>)",
    "llama-3.3": "its template is byte-identical to Llama 3.1's (llama-3.1 covers it)",
    "mistral-nemo-tekken": "Mistral's Tekken vocabulary (control tokens [INST], [/INST]) is not in the sdist",
    "deepseek-r1-distill-llama": "same template family as r1-distill-qwen; left out to keep the run short",
}


def root() -> Path:
    """The cache folder: SmolLM2's cache root (`smollm2.cache_dir`, $PAI_COOKBOOK_CACHE), llama-cpp-python-0.3.36/."""
    return smollm2.cache_dir() / f"{PACKAGE}-{VERSION}"


def write_atomically(folder: Path, fill) -> Path:
    """Make `folder` by filling `<folder>.partial` (`checkpoint.writing`: one writer, published whole or not at all)."""
    from pai_cookbook.core import checkpoint

    with checkpoint.writing(folder, overwrite=True) as partial:
        fill(partial)
    return folder


def _download(into: Path) -> Path:
    sdist, tail = smollm2.pip_download(f"{PACKAGE}=={VERSION}", into, ["--no-binary", ":all:"], "llama_cpp_python-*.tar.gz")
    if sdist is None:
        raise FetchError(f"could not fetch the {PACKAGE}=={VERSION} sdist with pip:\n{tail}\nOn a machine with "
                         f"access run `python -m pai_cookbook.real_templates` and copy the folder it fills "
                         f"({root().name}/ of $PAI_COOKBOOK_CACHE, default ~/.cache/pai_cookbook) to {root()}.")
    return sdist


def _extract(sdist: Path, into: Path, templates: bool = True) -> dict[str, int]:
    """Only the templates and the VOCABS files with their reference strings (`.gguf.inp`) and llama.cpp's ids for
    them (`.gguf.out`), each by its base name (nothing else of the archive is written)."""
    wanted = {MODELS + "templates/*.jinja": into / "templates"} if templates else {}
    wanted.update({MODELS + f"ggml-vocab-{name}.gguf{ext}": into / "vocab" for name in VOCABS
                   for ext in ("", ".inp", ".out")})
    counts = {"templates": 0, "vocab": 0}
    with tarfile.open(sdist, "r|gz") as archive:  # one pass over the stream
        for member in archive:
            target = next((d for pattern, d in wanted.items() if fnmatch.fnmatch(member.name, pattern)), None)
            if target is None or not member.isfile():
                continue
            target.mkdir(exist_ok=True)
            with archive.extractfile(member) as src, (target / Path(member.name).name).open("wb") as dst:
                shutil.copyfileobj(src, dst)
            counts[target.name] += 1
    missing = [n for n in VOCABS if not (into / "vocab" / f"ggml-vocab-{n}.gguf").exists()]
    if missing or (templates and not counts["templates"]):
        raise FetchError(f"{sdist.name} lacks {missing or 'the templates'}; it is not the {PACKAGE} {VERSION} sdist.")
    return counts


def fetch() -> Path:
    """The cache folder with templates/ and vocab/, fetched with pip the first time (~77 MB download).

    Raises:
        FetchError: pip could not fetch the sdist (the message gives the command to run by hand).
    """
    folder = root()
    if (folder / SOURCE_FILE).exists():
        return folder

    def fill(partial: Path) -> None:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="llama-cpp-python-") as scratch:
            counts = _extract(_download(Path(scratch)), partial)
        (partial / "tokenizers").mkdir()
        (partial / SOURCE_FILE).write_text(json.dumps({
            "package": f"{PACKAGE}=={VERSION}", "license": "MIT (llama-cpp-python, llama.cpp); each template is its "
            "model's", **counts, "seconds": round(time.perf_counter() - start, 1)}, indent=2))

    return write_atomically(folder, fill)


def vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's reference strings for the vocabulary ggml-vocab-`name`.gguf and the ids llama.cpp gives them
    (without BOS), as `(text, ids)` pairs. A cache fetched before these files were kept gets them once (pip's cache
    usually holds the sdist), in vocab-tests/ beside vocab/.

    Raises:
        FetchError: the sdist could not be fetched with pip.
    """
    folder = fetch() / "vocab"
    if not (folder / f"ggml-vocab-{name}.gguf.out").exists():
        folder = root() / "vocab-tests"
        if not (folder / SOURCE_FILE).exists():
            def fill(partial: Path) -> None:
                with tempfile.TemporaryDirectory(prefix="llama-cpp-python-") as scratch:
                    counts = _extract(_download(Path(scratch)), partial, templates=False)
                for gguf in (partial / "vocab").glob("*.gguf"):
                    gguf.unlink()  # vocab/ of the first fetch has them
                (partial / SOURCE_FILE).write_text(json.dumps({"package": f"{PACKAGE}=={VERSION}", **counts}))

            write_atomically(folder, fill)
        folder = folder / "vocab"
    texts = (folder / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    lines = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def _smollm2_folder() -> Path:
    try:
        return smollm2.hf_folder()
    except RuntimeError as err:  # it says how to bring the wheel by hand
        raise FetchError(str(err)) from None


def template_text(case: Case) -> str:
    """The Jinja text of a case's template."""
    if case.template is None:
        return (_smollm2_folder() / "chat_template.jinja").read_text()
    return (fetch() / "templates" / f"{case.template}.jinja").read_text()


def _checked_generation_eos(tokenizer, case: Case) -> list[int]:
    ids = []
    for token_id, token in case.generation_eos:
        found = tokenizer.convert_ids_to_tokens(token_id)
        if found != token:
            raise RuntimeError(f"{case.id}: generation_config.json lists {token_id} as {token!r}, but the "
                               f"{case.vocab} vocabulary has {found!r} there; the pairing is wrong.")
        ids.append(token_id)
    return ids


def _build(case: Case, partial: Path) -> None:
    from transformers import AddedToken, PreTrainedTokenizerFast

    if case.vocab == SMOLLM2:
        source = _smollm2_folder()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copy2(source / name, partial / name)
        return
    vocab = fetch() / "vocab"
    # PreTrainedTokenizerFast reads only the tokenizer part of the GGUF file (AutoTokenizer also builds the model
    # config, which fails on Gemma 4's per-layer head counts and takes 10x longer)
    with quiet_transformers():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(vocab, gguf_file=f"ggml-vocab-{case.vocab}.gguf")
    for token in case.special + case.plain:
        if token in tokenizer.get_vocab():
            raise RuntimeError(f"{case.id}: {token!r} is already in the {case.vocab} vocabulary; do not add it.")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in case.special], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in case.plain])
    if case.bos:
        tokenizer.bos_token = case.bos
    if case.eos:
        tokenizer.eos_token = case.eos
    tokenizer.chat_template = template_text(case)
    turn_end = tokenizer.convert_tokens_to_ids(case.turn_end)
    if tokenizer.convert_ids_to_tokens(turn_end) != case.turn_end:
        raise RuntimeError(f"{case.id}: the turn end {case.turn_end!r} is not one token of the {case.vocab} vocabulary.")
    tokenizer.save_pretrained(partial)
    if case.generation_eos:
        (partial / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": _checked_generation_eos(tokenizer, case)},
            indent=2))


def tokenizer_folder(case: Case) -> Path:
    """A Hugging Face tokenizer folder for `case`: tokenizer files, chat_template.jinja (the case's template) and, where
    the released model ships one listing its turn ends, generation_config.json. Made once, then cached.

    Raises:
        FetchError: the sdist could not be fetched with pip.
    """
    folder = fetch() / "tokenizers" / case.id
    if (folder / SOURCE_FILE).exists():
        return folder

    def fill(partial: Path) -> None:
        start = time.perf_counter()
        _build(case, partial)
        source = {"package": f"{PACKAGE}=={VERSION}", "template": case.template, "vocab": case.vocab,
                  "added_special": list(case.special), "added": list(case.plain), "note": case.note,
                  "seconds": round(time.perf_counter() - start, 1)}
        (partial / SOURCE_FILE).write_text(json.dumps(source, indent=2, ensure_ascii=False))

    return write_atomically(folder, fill)


WAYS = {"system='fold'": ("system", "fold"), "stop_tokens=": ("stop_tokens", None),
        "check_generation_prompt=False": ("check_generation_prompt", False)}
"""The ways through that `sft` refusals name (the text they write) and the option each sets; stop_tokens names the
case's turn end."""
REASONS = {"system": "the template has no system role", "stop_tokens": "no stop token after an answer",
           "check_generation_prompt": "the generation prompt is not what precedes an answer"}


def survey(conversations: list[dict], out_dir: str | Path, seq_length: int, cases: list[Case] | None = None,
           ) -> list[dict]:
    """`sft.prepare` of `conversations` on each template of `cases` (default: MATRIX): prepared as it is, or refused
    (the line and the reason) and then prepared with the way through the refusal names, up to one of each.

    Returns:
        One row per case: `case`, `refusals` (each the option taken, the line, a short reason and the message),
        `options`,
        and when prepared `answers`, `stop_tokens_trained`, `audit_mismatches` and `stop_tokens`; or `error`.
    """
    from pai_cookbook import sft

    rows = []
    for case in cases or MATRIX:
        folder, options, refusals, row = tokenizer_folder(case), {}, [], {"case": case.id}
        for attempt in range(len(WAYS) + 1):
            try:
                with quiet_transformers():
                    summary = sft.prepare(conversations, Path(out_dir) / f"{case.id}-{attempt}", folder,
                                          seq_length=seq_length, valid_fraction=0.0, **options)
            except sft.SFTError as err:
                message = str(err)
                named = sorted((message.find(text), option) for text, option in WAYS.items() if text in message)
                if not named or named[0][1][0] in options:
                    row["error"] = message
                    break
                option, value = named[0][1]
                options[option] = [case.turn_end] if option == "stop_tokens" else value
                where = re.search(r"line \d+", message)
                refusals.append({"option": option, "line": where.group(0) if where else "", "reason": REASONS[option],
                                 "message": message})
                continue
            audit = summary["audit"]
            row |= {"answers": audit["assistant_turns"], "stop_tokens_trained": audit["stop_tokens_trained"],
                    "audit_mismatches": audit["mismatched_samples"], "stop_tokens": summary["stop_tokens"]}
            shutil.rmtree(Path(out_dir) / f"{case.id}-{attempt}", ignore_errors=True)
            break
        rows.append(row | {"refusals": refusals, "options": options})
    return rows


def main() -> None:
    start = time.perf_counter()
    fetch()
    print(f"fetched: {time.perf_counter() - start:.1f}s ({root()})")
    for case in MATRIX:
        begin = time.perf_counter()
        folder = tokenizer_folder(case)
        print(f"{case.id:26} {case.vocab:13} {time.perf_counter() - begin:5.1f}s  {sorted(p.name for p in folder.iterdir())}")
    for name, why in NOT_BUILT.items():
        print(f"{name:26} not built: {why}")
    print(f"all: {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
