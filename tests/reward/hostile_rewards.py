"""Reward functions that hang or kill their process on chosen responses, for the reward-worker tests
(tests/reward/test_workers.py) and the trainer's end-to-end check. Worker processes import them by name:
`tests.reward.hostile_rewards:<name>`."""

import ctypes
import os
import signal
import time

from remax_megatron.reward.functions import PLACEHOLDER


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
    """Takes 0.2 s per response; with $REMAX_HOSTILE_DIR set, appends "pid start end" of the call to its
    slow.log there (whether the pool's calls run side by side)."""
    start = time.monotonic()
    time.sleep(0.2 * len(responses))
    directory = os.environ.get("REMAX_HOSTILE_DIR")
    if directory:
        with open(os.path.join(directory, "slow.log"), "a") as f:
            f.write(f"{os.getpid()} {start} {time.monotonic()}\n")
    return [1.0] * len(responses)


def hangs_where_told(prompts, responses, **_):
    """hangs() on a response containing $REMAX_HANG_ON (set in one rank only: that rank alone times out)."""
    told = os.environ.get("REMAX_HANG_ON")
    return hangs(prompts, [r.replace(told, "hang") if told else r for r in responses])


def _claim(directory: str, name: str) -> bool:
    try:
        os.close(os.open(os.path.join(directory, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def once(prompts, responses, **_):
    """0.0, except that in the whole job the first call (after the start-up call) sleeps forever and the first
    call on another response kills its process: the claims are files in $REMAX_HOSTILE_DIR."""
    directory = os.environ.get("REMAX_HOSTILE_DIR")
    if directory and responses != [PLACEHOLDER] * len(responses):
        me = repr((prompts, responses))
        if _claim(directory, "hang.claim"):
            with open(os.path.join(directory, "hung.tmp"), "w") as f:
                f.write(me)
            os.rename(os.path.join(directory, "hung.tmp"), os.path.join(directory, "hung"))
            while True:
                time.sleep(3600)
        hung = os.path.join(directory, "hung")
        if os.path.exists(hung) and open(hung).read() != me and _claim(directory, "die.claim"):
            os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(responses)
