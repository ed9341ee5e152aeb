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
