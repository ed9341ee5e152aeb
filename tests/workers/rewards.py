"""Reward functions of the RL tests (importable by the workers: torchrun's `-m` puts the repository root,
the tests' working directory, on their path)."""


def brevity(completion: str, record: dict) -> float:
    """Dense and learnable from a random model: shorter completions score higher (1 at empty)."""
    return 1.0 - min(len(completion), 200) / 200


def raises(completion: str, record: dict) -> float:
    raise KeyError("answer")


def text(completion: str, record: dict):
    return "1.0"


CALLS = [0]


def fails_on_the_third_step(completion: str, record: dict) -> float:
    """`brevity`, until its 17th call in a process: the first completion of the third step of a run of 8
    completions a step (the launcher's checks before launch are another process)."""
    CALLS[0] += 1
    if CALLS[0] > 16:
        raise ValueError("the reward service timed out")
    return brevity(completion, record)
