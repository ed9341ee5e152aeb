"""Numbers in a notebook's prose that its own run did not print.

    python ci/prose_numbers.py outputs/08_rlhf.ipynb      # an executed copy (ci/run_notebooks.py writes them)

A notebook's markdown may state a figure only where a cell of the same run prints it (or where the figure is a
definition, listed with its reason in `DEFINITIONS`). A number in the prose matches a printed one when the printed
one, rounded to the prose's precision, is the prose's value (prose 0.11 for a printed 0.1134; prose 97% for a printed
97.2% or 0.972). What is not a figure is skipped: numbers inside `code`, link targets, the numbers of headings, of
notebooks ("notebook 03") and of sections ("section 4"), and numbers that are part of a name (SmolLM2-135M, Qwen2.5,
e4m3, H100).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# A number standing alone: not glued to letters, underscores or a name's dots and hyphens.
NUMBER = re.compile(r"(?<![\w.\-/=^])[-+−]?\d[\d,]*+(?:\.\d+)?(?:e[-+]?\d+)?%?(?!\w|\.\d|,\d)")
# A number in code or output text (anything that looks like one: 0.1134, 96.1%, 1,975, 1.2e-05, -0.144).
PRINTED = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")

DEFINITIONS: dict[str, dict[str, str]] = {
    # notebook stem -> {number as the prose writes it: why it is not a measurement}
    "00_quickstart": {"1e-5": "the TP parity bound tests/test_notebooks.py asserts"},
    "01_convert_checkpoint": {"0.99999": "the cosine bound tests/test_notebooks.py asserts",
                              "1e-4": "the logit bound tests/test_notebooks.py asserts",
                              "1e-5": "the loss bound tests/test_notebooks.py asserts",
                              "2e-4": "the real model's logit bound tests/test_real_model.py asserts"},
    "02_extend_vocabulary": {"256": "Llama 3's special tokens outside its BPE vocabulary (Meta's layout)",
                             "768": "the control symbols Mistral v3 adds", "10,000": "real_tokenizers.LEARN",
                             "0.02": "a fresh model's initialisation std", "1e-3": "a bound tests/test_real_model.py asserts"},
    "03_continued_pretraining": {"98,2,0": "a SPLIT setting the prose names",
                                 "6": "training FLOPs per parameter and token (2 forward, 4 backward)",
                                 "989": "an H100 SXM's datasheet dense "
                                 "bf16 TFLOP/s (core.measures.throughput.DATASHEET_DENSE_TFLOPS)"},
    "10_lora": {"16": "bytes per parameter that full fine-tuning adds to bf16 weights (fp32 gradients, Adam's state)",
                "80": "an H100's memory in GB", "8": "a usual LoRA rank", "64": "a usual LoRA rank",
                "4": "bytes of an fp32 gradient", "12": "bytes of Adam's two moments and an fp32 master weight",
                "18": "bytes per parameter of full fine-tuning before activations (2 + 4 + 12)",
                "2": "bytes of a bf16 value"},
    "09_plan_a_run": {"80": "an H100's memory in GB", "16": "bytes per parameter of full fine-tuning before "
                      "activations (bf16 weights, fp32 gradients, Adam's state)"},
    "11_evaluate": {"1e-4": "the log-likelihood bound tests/test_harness.py asserts"},
    "12_preference_tuning": {"2023": "the year of the DPO and IPO papers", "2024": "the year of the SimPO paper"},
    "08_rlhf": {"1.16": "TRL's version", "259": "the byte-level tokenizer's size: 256 bytes and 3 special tokens",
                "0.95": "GAE's lambda (PPOConfig's default)", "20%": "the KL controller's clip (Ziegler et al.)",
                "0.05": "a bound tests/test_notebooks.py asserts", "0.1": "a bound tests/test_notebooks.py asserts",
                "1e-4": "a bound tests/test_notebooks.py asserts"},
}
"""Numbers a notebook's prose may state without a cell printing them: definitions, formats' constants, the
cookbook's stated bounds (each asserted by tests/test_notebooks.py), and counts a reader sets in a cell."""


def _value(token: str) -> tuple[float, int, bool]:
    """(value, decimals written, is a percentage) of a number as written."""
    text = token.replace(",", "").replace("−", "-").rstrip("%")
    mantissa = text.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return float(text), decimals, token.endswith("%")


def _matches(prose: str, printed: set[float]) -> bool:
    value, decimals, percent = _value(prose)
    if "e" in prose.lower():  # 1e-5: an order of magnitude; the printed figure must have it
        return any(p != 0 and abs(p - value) <= abs(value) * 0.5 for p in printed)
    for p in printed:
        for candidate in ((p, p * 100) if percent else (p,)):
            if round(abs(candidate), decimals) == round(abs(value), decimals) and (candidate < 0) == (value < 0):
                return True
            if decimals == 0 and abs(value) >= 1000 and abs(candidate - value) <= abs(value) * 0.005:  # 2,582 vs 2582
                return True
    return False


def _prose(source: str) -> str:
    text = re.sub(r"```.*?```", " ", source, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"^#+\s*[\d.]*", "", text, flags=re.M)  # a heading's own number
    text = re.sub(r"\b(sections?|steps?) \d+[a-z]?(?:(?:,| and| or| to) \d+[a-z]?)*", r"\1", text)  # "section 4": a reference
    return re.sub(r"<[^>]+>", " ", text)


def printed_numbers(cells: list[dict]) -> set[float]:
    """Every number the run showed: in its outputs (text, tables, markdown, HTML) and in its code (a count the reader
    set in a cell, a parameter)."""
    texts = []
    for cell in cells:
        if cell["cell_type"] == "code":
            texts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            for kind, data in output.get("data", {}).items():
                if kind.startswith("text/"):
                    texts.append("".join(data))
    found = set()
    for match in PRINTED.finditer("\n".join(texts)):
        try:
            found.add(float(match.group().replace(",", "").replace("−", "-")))
        except ValueError:
            continue
    return found


def unprinted(executed: Path, definitions: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(number, its sentence) for every number in `executed`'s markdown that no output or code of the run shows and
    `definitions` does not list."""
    cells = json.loads(Path(executed).read_text(encoding="utf-8"))["cells"]
    printed = printed_numbers(cells)
    allowed = definitions if definitions is not None else DEFINITIONS.get(Path(executed).stem, {})
    missing = []
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = _prose("".join(cell["source"]))
        for match in NUMBER.finditer(text):
            token = match.group().rstrip(",")
            if token in allowed or re.fullmatch(r"0\d", token) or _matches(token, printed):  # "03", "(06)": notebooks
                continue
            start = max(text.rfind(".", 0, match.start()) + 1, match.start() - 90)
            missing.append((token, " ".join(text[start:match.end() + 40].split())))
    return missing


def main(argv: list[str]) -> int:
    bad = 0
    for name in argv:
        for token, context in unprinted(Path(name)):
            print(f"{Path(name).stem}: {token!r} not printed by the run: ...{context}...")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
