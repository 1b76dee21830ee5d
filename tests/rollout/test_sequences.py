"""Prompt preparation, left padding, response packing and the log-prob mismatch monitor."""

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
    pack_sequences,
    prepare_prompts,
    tokenize_prompts,
)


def test_prepare_prompts_drop_and_truncate():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [], [9]]
    dropped = prepare_prompts(prompts, max_prompt_tokens=3, overlong="drop")
    assert dropped.token_ids == [[1, 2, 3], [9]] and dropped.indices == [0, 3]
    assert (dropped.dropped, dropped.truncated, dropped.empty) == (1, 0, 1)
    cut = prepare_prompts(prompts, max_prompt_tokens=3, overlong="truncate")
    assert cut.token_ids == [[1, 2, 3], [6, 7, 8], [9]] and cut.indices == [0, 1, 3]
    assert (cut.dropped, cut.truncated, cut.empty) == (0, 1, 1)


def test_prepare_prompts_bad_arguments():
    with pytest.raises(ValueError, match="data.overlong='cut'"):
        prepare_prompts([[1]], 3, "cut")
    with pytest.raises(ValueError, match="data.max_prompt_tokens=0"):
        prepare_prompts([[1]], 0)


def test_tokenize_prompts(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    out = tokenize_prompts(tok, ["abc", "abcdefgh"], max_prompt_tokens=4, overlong="truncate")
    assert tok.decode(out.token_ids[1]) == "efgh" and out.truncated == 1


def test_left_pad_positions_start_at_each_prompt():
    ids, mask, pos = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_pack_sequences_layout():
    prompts = [[11, 12, 13], [21]]
    comps = [Completion([31, 32], [-0.5, -0.25], "stop"), Completion([41, 42, 43, 44], [-1, -2, -3, -4], "length")]
    out = pack_sequences(prompts, comps, pad_id=0, pad_to_multiple=4)
    assert out["input_ids"].tolist() == [[11, 12, 13, 31, 32, 0, 0, 0], [21, 41, 42, 43, 44, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, -100, 31, 32, -100, -100, -100, -100],
                                      [41, 42, 43, 44, -100, -100, -100, -100]]
    assert out["response_mask"].tolist() == (out["labels"] != -100).tolist()
    assert out["engine_logprobs"][0, 2:4].tolist() == [-0.5, -0.25]
    assert out["engine_logprobs"][1, :4].tolist() == [-1, -2, -3, -4]
    assert out["engine_logprobs"][~out["response_mask"]].abs().sum() == 0
    assert out["lengths"].tolist() == [5, 5]
    assert out["prompt_lengths"].tolist() == [3, 1] and out["response_lengths"].tolist() == [2, 4]
    # labels[b, t] is input_ids[b, t + 1] wherever it is not ignored.
    ids, labels = out["input_ids"], out["labels"]
    valid = labels[:, :-1] != -100
    assert torch.equal(labels[:, :-1][valid], ids[:, 1:][valid])


def test_pack_sequences_bad_input():
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        pack_sequences([[1], [2]], [Completion([3], [-1.0], "stop")], 0)
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        pack_sequences([[]], [Completion([3], [-1.0], "stop")], 0)
    with pytest.raises(ValueError, match="1 tokens but 2 log-probs"):
        pack_sequences([[1]], [Completion([3], [-1.0, -2.0], "stop")], 0)


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
    assert empty == {"max": 0.0, "mean": 0.0, "below": 0.0, "tokens": 0}
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
