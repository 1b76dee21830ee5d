"""User reward functions that go wrong on one rank only (RANK=1), for tests/train/test_faults.py.

Imported by the training processes as `tests.reward.faulty_rewards:<name>`."""

import os


def _bad_rank() -> bool:
    return os.environ.get("RANK") == "1"


def raises(prompts, responses, **_):
    if _bad_rank():
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(responses)


def nan(prompts, responses, **_):
    return [float("nan") if _bad_rank() else 0.0] * len(responses)


def short(prompts, responses, **_):
    return [0.0] * (len(responses) - (1 if _bad_rank() else 0))
