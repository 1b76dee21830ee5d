"""Left padding for decoding, rollouts flattened into rows, and the log-prob mismatch monitor."""

import warnings

import pytest
import torch

from remax_megatron.rollout import (
    Completion,
    LogprobMismatchWarning,
    PromptRollout,
    flatten_rollouts,
    left_pad,
    logprob_mismatch,
)


def test_left_pad_positions_start_at_each_prompt():
    ids, mask, pos = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_flatten_rollouts_orders_sampled_then_greedy():
    s = [Completion([1], [-1.0], "stop"), Completion([2], [-1.0], "stop")]
    g = Completion([3], [-1.0], "stop")
    rows_p, rows_c = flatten_rollouts([[9]], [PromptRollout(sampled=s, greedy=g)], include_greedy=True)
    assert rows_p == [[9], [9], [9]] and [c.token_ids for c in rows_c] == [[1], [2], [3]]
    rows_p, rows_c = flatten_rollouts([[9]], [PromptRollout(sampled=s, greedy=g)])
    assert len(rows_c) == 2


def test_logprob_mismatch_and_warning():
    actor = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 5.0]])
    engine = torch.tensor([[-1.1, -2.0, -3.3], [-1.0, -0.8, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = logprob_mismatch(actor, engine, mask, threshold=0.5)
    assert abs(stats["max"] - 0.3) < 1e-6 and abs(stats["mean"] - 0.6 / 5) < 1e-6 and stats["tokens"] == 5
    with pytest.warns(LogprobMismatchWarning, match="rollout.logprob_warn_threshold=0.1"):
        logprob_mismatch(actor, engine, mask, threshold=0.1)
    empty = logprob_mismatch(actor, engine, torch.zeros_like(mask))
    assert empty == {"max": 0.0, "mean": 0.0, "below": 0.0, "tokens": 0, "sd": 0.0, "exp_mean": 1.0}
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_mismatch(actor, engine[:, :2], mask)


def test_a_constrained_engine_is_only_wrong_below_the_actor():
    """Guided decoding renormalises over the allowed tokens: the engine's log-probs sit above the actor's by
    design (here by up to 2.0, no warning); an engine below the actor (a stale sync) still warns."""
    actor = torch.tensor([[-3.0, -2.0, -1.5]])
    mask = torch.ones_like(actor, dtype=torch.bool)
    above = actor + torch.tensor([[2.0, 0.5, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = logprob_mismatch(actor, above, mask, threshold=0.05, constrained=True)
    assert stats["max"] == pytest.approx(2.0) and stats["below"] == 0.0
    with pytest.warns(LogprobMismatchWarning, match="below the actor's"):
        stats = logprob_mismatch(actor, above - torch.tensor([[0.0, 0.0, 0.3]]), mask, threshold=0.05, constrained=True)
    assert stats["below"] == pytest.approx(0.3)
