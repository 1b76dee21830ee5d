"""Reward functions that hang or kill their process on chosen responses, for the reward-worker tests
(tests/reward/test_workers.py) and the trainer's end-to-end check. Worker processes import them by name:
`tests.reward.hostile_rewards:<name>`."""

import ctypes
import os
import signal
import time


def _fractional(text: str) -> float:
    """A score with many significant bits (the pool's totals must equal the in-process ones exactly)."""
    return sum((ord(c) * 0.1) / (k + 3) for k, c in enumerate(text)) / 7.0


def hangs(prompts, responses, **_):
    """Sleeps forever on a response containing "hang"."""
    out = []
    for r in responses:
        while "hang" in r:
            time.sleep(3600)
        out.append(_fractional(r))
    return out


def dies(prompts, responses, **_):
    """Kills its own process on a response containing "die" (SIGKILL), "exit" (os._exit) or "segv" (a null read)."""
    for r in responses:
        if "die" in r:
            os.kill(os.getpid(), signal.SIGKILL)
        if "exit" in r:
            os._exit(3)
        if "segv" in r:
            ctypes.string_at(0)
    return [len(r) / 3.0 for r in responses]


def raises(prompts, responses, **_):
    """Raises on a response containing "boom"."""
    if any("boom" in r for r in responses):
        raise ArithmeticError("boom")
    return [1.0] * len(responses)


def slow(prompts, responses, **_):
    """Takes 0.2 s per response (the pool's calls run side by side)."""
    time.sleep(0.2 * len(responses))
    return [1.0] * len(responses)
