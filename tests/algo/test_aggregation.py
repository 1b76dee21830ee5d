"""Loss aggregation modes equal their fp64 formulas and are micro-batch invariant."""

import pytest
import torch

from remax_megatron.algo import AGG_MODES, aggregate


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(8, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(8, 6, generator=g) > 0.3
    mask[2] = False  # no response tokens
    mask[3, :] = False
    mask[3, 0] = True
    return vals, mask


def _formula(vals, mask, mode, n_tok, n_seq):
    total = 0.0
    for b in range(vals.shape[0]):
        row = [float(vals[b, t]) for t in range(vals.shape[1]) if mask[b, t]]
        if mode == "token-mean":
            total += sum(row) / n_tok
        elif mode == "seq-mean-token-sum":
            total += sum(row) / n_seq
        else:
            total += (sum(row) / len(row) if row else 0.0) / n_seq
    return total


@pytest.mark.parametrize("mode", AGG_MODES)
def test_formula(mode):
    vals, mask = _data()
    got = aggregate(vals, mask, mode, global_num_tokens=100, global_num_seqs=13)
    assert abs(float(got) - _formula(vals, mask, mode, 100, 13)) < 1e-12
    local = aggregate(vals, mask, mode)  # local counts
    n_tok, n_seq = int(mask.sum()), vals.shape[0]
    assert abs(float(local) - _formula(vals, mask, mode, n_tok, n_seq)) < 1e-12


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_the_global_loss(mode):
    vals, mask = _data(1)
    n_tok, n_seq = int(mask.sum()), vals.shape[0]
    whole = aggregate(vals, mask, mode, global_num_tokens=n_tok, global_num_seqs=n_seq)
    parts = sum(
        aggregate(v, m, mode, global_num_tokens=n_tok, global_num_seqs=n_seq)
        for v, m in zip(vals.split(2), mask.split(2))
    )
    torch.testing.assert_close(parts, whole)


@pytest.mark.parametrize(
    "kw,arg",
    [
        (dict(mode="mean"), "loss_agg_mode"),
        (dict(global_num_tokens=0), "global_num_tokens"),
        (dict(mode="seq-mean-token-sum", global_num_seqs=-1), "global_num_seqs"),
    ],
)
def test_bad_input(kw, arg):
    vals, mask = _data()
    with pytest.raises(ValueError, match=f"^{arg}:"):
        aggregate(vals, mask, **kw)


def test_mask_shape_mismatch():
    vals, mask = _data()
    with pytest.raises(ValueError, match="^mask:"):
        aggregate(vals, mask[:, :3])
