"""Reward functions of the RL tests (importable by the workers: torchrun's `-m` puts the repository root,
the tests' working directory, on their path)."""


def brevity(completion: str, record: dict) -> float:
    """Dense and learnable from a random model: shorter completions score higher (1 at empty)."""
    return 1.0 - min(len(completion), 200) / 200


def raises(completion: str, record: dict) -> float:
    raise KeyError("answer")


def text(completion: str, record: dict):
    return "1.0"
