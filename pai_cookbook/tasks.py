"""A small task with a checkable answer, for reinforcement learning on a tiny model: sorting digits.

    prompts = tasks.sorting(256, seed=1)                        # {"messages": [user turn], "answer": "1 2 3"}
    conversations = tasks.sorting_sft(3000, seed=0, copy_share=0.5)   # supervised data, with its mistakes
    pairs = tasks.sorting_pairs(2000, seed=2)                   # {"messages", "chosen", "rejected"}

"Sort: 3 1 2" is answered "1 2 3" (3-5 digits). `rewards.exact_answer` and `rewards.positional_match` check an
answer. The supervised set can carry a share of answers that copy the digits unsorted: the mistakes a
fine-tuning set has and a fine-tuned model imitates, which a reward then trains away. The preference pairs set
the sorted answer against one of the same length that is wrong: the digits unsorted, two neighbours swapped,
or one digit changed, so length alone tells nothing (`reward_model.length_baseline` is 0.5 on them).
"""

from __future__ import annotations

import random
from typing import Any

MIN_DIGITS, MAX_DIGITS = 3, 5


def _digits(rng: random.Random) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]


def _text(digits: list[int]) -> str:
    return " ".join(map(str, digits))


def _question(digits: list[int]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Sort: {_text(digits)}"}]


def sorting(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` prompts {"messages": [the question], "answer": the sorted digits}."""
    rng = random.Random(seed)
    return [{"messages": _question(d), "answer": _text(sorted(d))} for d in (_digits(rng) for _ in range(count))]


def sorting_sft(count: int, seed: int, copy_share: float = 0.0) -> list[dict[str, Any]]:
    """`count` conversations answering the question; a `copy_share` of them (drawn at random) answer with the
    digits as given, unsorted."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        digits = _digits(rng)
        answer = digits if rng.random() < copy_share else sorted(digits)
        out.append({"messages": _question(digits) + [{"role": "assistant", "content": _text(answer)}]})
    return out


def _wrong(digits: list[int], rng: random.Random) -> list[int]:
    """An answer of the same length that is not the sorted digits."""
    right = sorted(digits)
    kind = rng.choice(("unsorted", "swap", "digit"))
    if kind == "unsorted" and digits != right:
        return list(digits)
    wrong = list(right)
    if kind == "digit":
        i = rng.randrange(len(wrong))
        wrong[i] = (wrong[i] + rng.randint(1, 9)) % 10
        return wrong
    i = rng.randrange(len(wrong) - 1)  # swap two neighbours; equal neighbours: change one instead
    if wrong[i] == wrong[i + 1]:
        wrong[i] = (wrong[i] + 1) % 10
    else:
        wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
    return wrong


def sorting_pairs(count: int, seed: int) -> list[dict[str, Any]]:
    """`count` preference pairs: the sorted digits chosen, a wrong answer of the same length rejected."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        digits = _digits(rng)
        out.append({"messages": _question(digits), "chosen": _text(sorted(digits)),
                    "rejected": _text(_wrong(digits, rng)), "answer": _text(sorted(digits))})
    return out
