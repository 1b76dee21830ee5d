"""Tools for the tool tests (rollout.tools=[tests.agent.tool_fns:<name>])."""

import threading
import time


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def fails(x: str) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError("tool broke")


def sleeps(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def not_text(x: int) -> str:
    """Returns a number, not text.

    Args:
        x: a number
    """
    return x


def undocumented(x: int) -> str:
    return str(x)


def untyped(x):
    """No type hints.

    Args:
        x: something
    """
    return str(x)


MEETING = threading.Barrier(4, timeout=5)


def meets(who: int) -> str:
    """Waits until 4 calls are inside at once (calls run one after another never meet).

    Args:
        who: a caller id
    """
    try:
        MEETING.wait()
    except threading.BrokenBarrierError:
        return f"{who} alone"
    return f"{who} met"


def floods(chars: int) -> str:
    """Returns `chars` characters: a head line, filler and a last line.

    Args:
        chars: how many characters
    """
    return "HEAD\n" + "x" * (chars - 10) + "\nTAIL"
