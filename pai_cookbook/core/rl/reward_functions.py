"""A reward function, named as "module:function" (`resolve_reward`) and called with its result checked (`score`): the
RL recipe tries each on what a sampled completion may be before launch, and the RL worker scores every completion
with it."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from pai_cookbook.core.configs.model_config import ConfigError
from pai_cookbook.core.launching.inputs import prompt_text
from pai_cookbook.core.rl.rl_math import RLError

Reward = Callable[[str, dict[str, Any]], float]


def resolve_reward(spec: str) -> Reward:
    """The function a "module:function" string names (it must be importable in the workers too)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"reward {spec!r}: name it as 'module:function', e.g. 'pai_cookbook.rewards:exact_answer'; "
                          f"the workers import it, so a function defined in a notebook cell must move to a .py file.")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward {spec!r} cannot be imported ({err}); is {module} on the Python path?") from err
    if not callable(function):
        raise ConfigError(f"reward {spec!r} is a {type(function).__name__}, not a function.")
    return function


def score(reward: Reward, completion: str, record: dict[str, Any], what: str = "the reward function") -> float:
    """One reward, checked: a finite number, or an RLError naming the function, the prompt and the completion."""
    where = f"prompt {record.get('line', '?')} ({prompt_text(record)[:60]!r}), completion {completion[:60]!r}"
    try:
        value = reward(completion, record)
    except Exception as err:  # noqa: BLE001 -- a user's function; its error is reported with the prompt it failed on
        raise RLError(f"{what} raised {type(err).__name__}: {err} on {where}.") from err
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RLError(f"{what} returned {value!r} ({type(value).__name__}) on {where}; it must return a finite int "
                      f"or float.")
    return float(value)
