"""batching/padding.py: the right-padded row layout the loss reads, and its one-line refusals."""

import pytest
import torch

from remax_megatron.batching import pad_sequences, round_up
from remax_megatron.rollout import Completion


def test_round_up_is_the_next_multiple():
    assert [round_up(v, 4) for v in (1, 4, 5, 8)] == [4, 4, 8, 8] and round_up(7, 1) == 7


def test_pad_sequences_layout():
    prompts = [[11, 12, 13], [21]]
    comps = [Completion([31, 32], [-0.5, -0.25], "stop"), Completion([41, 42, 43, 44], [-1, -2, -3, -4], "length")]
    out = pad_sequences(prompts, comps, pad_id=0, pad_to_multiple=4)
    assert out["input_ids"].tolist() == [[11, 12, 13, 31, 32, 0, 0, 0], [21, 41, 42, 43, 44, 0, 0, 0]]
    assert out["labels"].tolist() == [
        [-100, -100, 31, 32, -100, -100, -100, -100],
        [41, 42, 43, 44, -100, -100, -100, -100],
    ]
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


def test_pad_sequences_bad_input():
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        pad_sequences([[1], [2]], [Completion([3], [-1.0], "stop")], 0)
    with pytest.raises(ValueError, match="row 0 has an empty prompt"):
        pad_sequences([[]], [Completion([3], [-1.0], "stop")], 0)
    with pytest.raises(ValueError, match="1 tokens but 2 log-probs"):
        pad_sequences([[1]], [Completion([3], [-1.0, -2.0], "stop")], 0)


def _routed(tokens: int, expert: int) -> Completion:
    """A completion of `tokens` tokens after a 1-token prompt, every fed token routed to `expert` in 2 layers."""
    return Completion(
        list(range(3, 3 + tokens)), [-1.0] * tokens, "stop", routed_experts=torch.full((tokens, 2, 1), expert)
    )  # [fed tokens, layers, top_k]


def test_routes_follow_the_one_switch_and_a_missing_route_is_refused():
    rows = [[1], [2]], [_routed(2, 5), _routed(1, 7)]
    routed = pad_sequences(*rows, pad_id=0, routes=True)["routed_experts"]  # [B, S, layers, top_k]
    assert routed.shape == (2, 3, 2, 1)
    assert routed[0, :2].eq(5).all() and routed[0, 2:].eq(-1).all()  # the last token was never fed
    assert routed[1, :1].eq(7).all() and routed[1, 1:].eq(-1).all()
    # rollout.routing_replay=false: no routes in the batch even when the engine returned them
    assert "routed_experts" not in pad_sequences(*rows, pad_id=0)
    unrouted = [[1], [2]], [_routed(2, 5), Completion([3], [-1.0], "stop")]
    with pytest.raises(ValueError, match=r"^row 1 has no routed experts but rollout.routing_replay=true"):
        pad_sequences(*unrouted, pad_id=0, routes=True)


def test_mask_truncated_leaves_the_cut_sample_out_of_the_loss_and_its_counts():
    """trainer.mask_truncated: the sample cut at the length limit has no token in response_mask, so the
    token-mean loss over the batch is the hand-computed one over the other rows (fp64), and the global
    token count (what the update divides by) excludes it; its labels and engine log-probs stay."""
    from remax_megatron.kernels import remax_loss

    prompts = [[11, 12], [21, 22], [31]]
    comps = [
        Completion([1, 2, 3], [-0.1, -0.2, -0.3], "stop"),
        Completion([4, 5, 6, 7], [-1, -2, -3, -4], "length"),
        Completion([8], [-0.5], "stop"),
    ]
    plain = pad_sequences(prompts, comps, pad_id=0)
    out = pad_sequences(prompts, comps, pad_id=0, mask_truncated=True)
    assert out["response_mask"][1].sum() == 0 and out["response_mask"][[0, 2]].equal(plain["response_mask"][[0, 2]])
    assert out["labels"].equal(plain["labels"]) and out["engine_logprobs"].equal(plain["engine_logprobs"])
    logprobs = -torch.arange(1, 1 + out["labels"].numel(), dtype=torch.float64).view(out["labels"].shape) / 10
    adv = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64)
    mask = out["response_mask"]
    loss, _ = remax_loss(logprobs, adv, mask, global_num_tokens=float(mask.sum()))
    # by hand: rows 0 (3 tokens, A = 0.5) and 2 (1 token, A = -1) over their 4 tokens; row 1 is out
    lp = logprobs.tolist()
    want = -(0.5 * (lp[0][1] + lp[0][2] + lp[0][3]) + -1.0 * lp[2][0]) / 4
    assert float(mask.sum()) == 4 and abs(loss.item() - want) < 1e-12
