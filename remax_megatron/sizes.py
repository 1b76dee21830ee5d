"""Integer size rules every layer shares (no torch: config checks import this at load).

    round_up(13, 4) == 16                 # a width under sequence parallel, a padded vocab, an aligned buffer
    ceil_div(13, 4) == 4                  # items per replica, prompts per engine
    sequence_multiple(tp=2, sequence_parallel=True) == 2
    check_token_budget(budget, longest)   # trainer.micro_batch_tokens holds one row of `longest` tokens

Each formula is written here once; config checks, the memory planner (plan.py) and the runtime
(batching, the reward scorer, the models) call these.
"""

from __future__ import annotations


def ceil_div(value: int, divisor: int) -> int:
    """ceil(value / divisor) for integers (exact for any size, unlike math.ceil of a float)."""
    return -(-value // divisor)


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return ceil_div(value, multiple) * multiple


def sequence_multiple(tp: int, sequence_parallel: bool) -> int:
    """Sequence lengths must be a multiple of this: tp with sequence parallel (each TP rank holds 1/tp of
    the sequence), else 1. Also the factor the norms' activations are split by."""
    return tp if sequence_parallel else 1


def check_token_budget(budget: int, longest: int, what: str = "") -> None:
    """trainer.micro_batch_tokens (`budget`, padding included) holds one row of `longest` tokens (already
    rounded up to the sequence multiple); `what` spells out where `longest` comes from."""
    if budget < longest:
        raise ValueError(
            f"trainer.micro_batch_tokens={budget} is smaller than one row of "
            f"{what or f'{longest} tokens'}: raise it to at least {longest}"
        )
