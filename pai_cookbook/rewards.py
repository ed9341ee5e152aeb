"""Verifiable rewards: `reward(completion, record) -> float`, named to `rlhf.grpo` as "pai_cookbook.rewards:NAME".

A reward runs in the RL worker on global rank 0, once per sampled completion; `record` is the prompt's
record as given (its "answer" and any other field the function reads). Write your own the same way in an
importable .py file (a function defined in a notebook cell cannot reach the workers).
"""

from __future__ import annotations

from typing import Any


def exact_answer(completion: str, record: dict[str, Any]) -> float:
    """1.0 when the completion, stripped, is the record's "answer", else 0.0."""
    return float(completion.strip() == str(record["answer"]).strip())


def positional_match(completion: str, record: dict[str, Any]) -> float:
    """Partial credit: the share of the answer's words the completion has in the same position, over the
    longer of the two (a missing or extra word counts as wrong). 1.0 only for the exact answer's words."""
    got, want = completion.split(), str(record["answer"]).split()
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)
