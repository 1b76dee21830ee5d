"""User reward functions that go wrong on one rank only (RANK=1), during training, for
tests/train/test_faults.py. The start-up call (every response the placeholder completion) passes on
every rank, as a deterministic function's would: the failure comes a step in.

Imported by the training processes as `tests.reward.faulty_rewards:<name>`."""

import os

from remax_megatron.reward.functions import PLACEHOLDER


def _bad(responses) -> bool:
    return os.environ.get("RANK") == "1" and any(r != PLACEHOLDER for r in responses)


def raises(prompts, responses, **_):
    if _bad(responses):
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(responses)


def nan(prompts, responses, **_):
    return [float("nan") if _bad(responses) else 0.0] * len(responses)


def short(prompts, responses, **_):
    return [0.0] * (len(responses) - (1 if _bad(responses) else 0))
