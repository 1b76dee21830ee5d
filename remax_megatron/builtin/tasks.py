"""Built-in tasks that need no downloads.

``builtin_task("arith")`` is single-digit addition: all 100 prompts ``"a+b="``
(a, b in 0..9) with the answer ``str(a + b)``, split by a fixed seed into 80
train and 20 held-out eval records. The trainer feeds the prompt text as is
(no chat template); the response is the answer followed by EOS (``</s>``).
"""

from __future__ import annotations

import random

ARITH_EVAL_SIZE = 20
ARITH_SPLIT_SEED = 1234
TASKS = ("arith",)


def arith_records() -> list[dict]:
    """All 100 single-digit addition records, in (a, b) order."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def builtin_task(name: str) -> dict:
    """``{"train": [...], "eval": [...]}`` of ``{"prompt", "answer"}`` records for a built-in task."""
    if name != "arith":
        raise ValueError(f"unknown built-in task {name!r}: choose one of {', '.join(TASKS)}")
    records = arith_records()
    order = list(range(len(records)))
    random.Random(ARITH_SPLIT_SEED).shuffle(order)
    held = set(order[:ARITH_EVAL_SIZE])
    return {
        "train": [dict(r) for i, r in enumerate(records) if i not in held],
        "eval": [dict(r) for i, r in enumerate(records) if i in held],
    }
