"""Built-in tasks that need no downloads.

``builtin_task("arith")`` is single-digit addition: all 100 prompts ``"a+b="``
(a, b in 0..9) with the answer ``str(a + b)``, split by a fixed seed into 80
train and 20 held-out eval records. The trainer feeds the prompt text as is
(no chat template); the response is the answer followed by EOS (``</s>``).

``builtin_task("multiply")`` is two-digit multiplication, the tool-use task of the built-in agent
(configs/tiny_cpu_agent.yaml): all 4624 prompts ``"a*b"`` (a, b in 32..99, so every product has four
digits) with the answer ``str(a * b)``, split by a fixed seed into 4524 train and 100 held-out eval
records. The prompt is a user turn of the chat template, which also tells the model its tools.
"""

from __future__ import annotations

import random

ARITH_EVAL_SIZE = 20
ARITH_SPLIT_SEED = 1234
MULTIPLY_RANGE = range(32, 100)  # 32 * 32 = 1024, 99 * 99 = 9801: four digits
MULTIPLY_EVAL_SIZE = 100
TASKS = ("arith", "multiply")


def arith_records() -> list[dict]:
    """All 100 single-digit addition records, in (a, b) order."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def multiply_records() -> list[dict]:
    """All two-digit multiplication records of MULTIPLY_RANGE, in (a, b) order."""
    return [{"prompt": f"{a}*{b}", "answer": str(a * b)} for a in MULTIPLY_RANGE for b in MULTIPLY_RANGE]


def builtin_task(name: str) -> dict:
    """``{"train": [...], "eval": [...]}`` of ``{"prompt", "answer"}`` records for a built-in task."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}: choose one of {', '.join(TASKS)}")
    records, held_size = (
        (arith_records(), ARITH_EVAL_SIZE) if name == "arith" else (multiply_records(), MULTIPLY_EVAL_SIZE)
    )
    order = list(range(len(records)))
    random.Random(ARITH_SPLIT_SEED).shuffle(order)
    held = set(order[:held_size])
    return {
        "train": [dict(r) for i, r in enumerate(records) if i not in held],
        "eval": [dict(r) for i, r in enumerate(records) if i in held],
    }
