"""DAPO's overlong reward shaping (Yu et al., 2025): a soft penalty over the last `buffer` tokens before the
completion length limit, added to the reward of every scored response, samples and greedy alike (the
greedy baseline goes through the same reward, so r(sample) - r(greedy) compares like with like).

For a completion of L tokens, limit M = rollout.max_new_tokens, buffer B = reward.overlong_buffer and
penalty p = reward.overlong_penalty:

    shaping(L) = 0                      L <= M - B
               = -p * (L - (M - B)) / B  M - B < L <= M        (-p at the limit itself)
"""

from __future__ import annotations


def overlong_shaping(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """The penalty (<= 0) added to the reward of a completion of `length` tokens (0 with buffer 0)."""
    if not buffer:
        return 0.0
    over = length - (max_new_tokens - buffer)
    return -penalty * min(over, buffer) / buffer if over > 0 else 0.0


def shape_rewards(
    scores: list[list[float]], lengths: list[list[int]], max_new_tokens: int, buffer: int, penalty: float
) -> tuple[list[list[float]], list[float]]:
    """scores[i][j] of prompt i's response j (samples then greedy) with their completion lengths -> the
    shaped scores (same shape) and every response's penalty, flat (for reward/overlong_penalty_mean)."""
    shaped, penalties = [], []
    for row, row_lengths in zip(scores, lengths):
        cuts = [overlong_shaping(n, max_new_tokens, buffer, penalty) for n in row_lengths]
        shaped.append([s + c for s, c in zip(row, cuts)])
        penalties.extend(cuts)
    return shaped, penalties


def shape_overlong(scores: list[list[float]], responses: list[list[tuple]], cfg, metrics: dict) -> list[list[float]]:
    """The trainer's scores with reward.overlong_buffer's shaping (unchanged when it is 0); adds
    reward/overlong_penalty_mean to `metrics`. responses[i][j] = (token_ids, text) of scores[i][j]."""
    if not cfg.reward.overlong_buffer:
        return scores
    shaped, penalties = shape_rewards(
        scores,
        [[len(ids) for ids, _ in row] for row in responses],
        cfg.rollout.max_new_tokens,
        cfg.reward.overlong_buffer,
        cfg.reward.overlong_penalty,
    )
    metrics["reward/overlong_penalty_mean"] = sum(penalties) / len(penalties)
    return shaped
