"""Write the cookbook's instruction set: data/sft/arithmetic.jsonl (training) and arithmetic_test.jsonl
(held-out first questions). Notebook 06 fine-tunes on it.

A task a tiny model can visibly learn: answer arithmetic questions, asked in several phrasings, in one
fixed format ("The answer is N."), and end the turn. Conversations run from one to six turns, some with a
system message, so their lengths are skewed (what makes packing pay). Run: python scripts/make_sft_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "sft"
SYSTEM = "You are a careful calculator. Reply in the form 'The answer is N.'"
FIRST = {"+": ["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}.", "{a} + {b} = ?",
               "What do you get when you add {b} to {a}?"],
         "-": ["What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} minus {b}.", "{a} - {b} = ?",
               "What is left when you take {b} away from {a}?"]}
FOLLOW = {"+": ["Now add {c}.", "And plus {c}?", "Add {c} to that."],
          "-": ["Now subtract {c}.", "And minus {c}?", "Take {c} away from that."]}


def question(rng: random.Random) -> tuple[str, int]:
    op = rng.choice("+-")
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    if op == "-" and b > a:
        a, b = b, a
    return rng.choice(FIRST[op]).format(a=a, b=b), a + b if op == "+" else a - b


def conversation(rng: random.Random) -> dict:
    turns = rng.choices([1, 2, 3, 4, 5, 6], weights=[50, 20, 12, 8, 6, 4])[0]
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    text, value = question(rng)
    for turn in range(turns):
        if turn:
            op, c = rng.choice("+-"), rng.randint(1, 20)
            text = rng.choice(FOLLOW[op]).format(c=c)
            value = value + c if op == "+" else value - c
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": f"The answer is {value}."}]
    return {"messages": messages}


def main() -> None:
    rng = random.Random(0)
    train = [conversation(rng) for _ in range(2000)]
    seen = {next(m["content"] for m in c["messages"] if m["role"] == "user") for c in train}  # first questions
    test = []
    while len(test) < 64:
        text, value = question(rng)
        if text not in seen and text not in {t["prompt"] for t in test}:
            test.append({"prompt": text, "answer": value})
    OUT.mkdir(parents=True, exist_ok=True)
    for name, records in (("arithmetic.jsonl", train), ("arithmetic_test.jsonl", test)):
        (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
