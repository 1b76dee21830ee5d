"""remax_loss: hand-written fp64 formulas, micro-batch invariance, bad input."""

import math

import pytest
import torch

from remax_megatron.kernels import logprob_gradient, remax_loss


def _batch(seed=0, b=8, t=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = lp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    ent = torch.rand(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[1] = False
    return lp, old, ref, adv, ent, mask


def _per_token(lp, old, ref, a, ent, eps, kl_coef, est, ent_coef):
    if old is None:
        pg = -a * lp
    else:
        ratio = math.exp(lp - old)
        pg = max(-a * ratio, -a * min(max(ratio, 1 - eps), 1 + eps))
    d = lp - ref
    kl = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[est]
    return pg + kl_coef * kl - ent_coef * ent


def _formula(lp, old, ref, adv, ent, mask, mode, n_tok, n_seq, **kw):
    total = 0.0
    for b in range(lp.shape[0]):
        row = [
            _per_token(
                float(lp[b, t]),
                None if old is None else float(old[b, t]),
                float(ref[b, t]),
                float(adv[b]),
                float(ent[b, t]),
                **kw,
            )
            for t in range(lp.shape[1])
            if mask[b, t]
        ]
        if mode == "token-mean":
            total += sum(row) / n_tok
        elif mode == "seq-mean-token-sum":
            total += sum(row) / n_seq
        else:
            total += (sum(row) / len(row) if row else 0.0) / n_seq
    return total


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_formula(mode, use_old, est):
    lp, old, ref, adv, ent, mask = _batch()
    kw = dict(eps=0.2, kl_coef=0.1, est=est, ent_coef=0.01)
    loss, stats = remax_loss(
        lp,
        adv,
        mask,
        loss_agg_mode=mode,
        global_num_tokens=40,
        global_num_seqs=11,
        old_logprobs=old if use_old else None,
        clip_eps=0.2,
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_estimator=est,
        entropy=ent,
        entropy_coef=0.01,
    )
    want = _formula(lp, old if use_old else None, ref, adv, ent, mask, mode, 40, 11, **kw)
    assert abs(float(loss) - want) < 1e-12
    assert set(stats) >= {"pg_loss", "kl", "entropy", "clip_frac", "ratio", "adv", "loss"}
    if not use_old:
        assert float(stats["clip_frac"]) == 0.0


def test_per_token_advantages_equal_broadcast():
    lp, _, _, adv, _, mask = _batch(1)
    a, _ = remax_loss(lp, adv, mask)
    b, _ = remax_loss(lp, adv[:, None].expand_as(lp).clone(), mask)
    torch.testing.assert_close(a, b)


def test_clip_fraction_counts_clipped_tokens():
    lp = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.0, -1.0, 1.0]], dtype=torch.float64)  # ratio 1, e, 1/e
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, stats = remax_loss(lp, torch.tensor([1.0]), mask, old_logprobs=old, clip_eps=0.2)
    # A > 0: clipped when ratio > 1 + eps (e), not when ratio < 1 - eps (pg keeps the min)
    assert abs(float(stats["clip_frac"]) - 1 / 3) < 1e-12


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_same_for_1_and_4_micro_batches(mode):
    lp0, old, ref, adv, ent, mask = _batch(2, b=8, t=6)
    n_tok, n_seq = int(mask.sum()), 8
    kw = dict(loss_agg_mode=mode, global_num_tokens=n_tok, global_num_seqs=n_seq, kl_coef=0.05, kl_estimator="k3")
    lp1 = lp0.clone().requires_grad_()
    remax_loss(lp1, adv, mask, old_logprobs=old, ref_logprobs=ref, **kw)[0].backward()
    lp4 = lp0.clone().requires_grad_()
    for idx in torch.arange(8).split(2):
        remax_loss(lp4[idx], adv[idx], mask[idx], old_logprobs=old[idx], ref_logprobs=ref[idx], **kw)[0].backward()
    torch.testing.assert_close(lp4.grad, lp1.grad, rtol=0, atol=1e-14)


def test_without_old_logprobs_gradient_is_minus_advantage():
    lp, _, _, adv, _, mask = _batch(3)
    lp = lp.clone().requires_grad_()
    n = int(mask.sum())
    remax_loss(lp, adv, mask, global_num_tokens=n)[0].backward()
    torch.testing.assert_close(lp.grad, -adv[:, None] * mask / n)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_logprob_gradient_is_the_on_policy_loss_gradient_anywhere(mode):
    """The fused kernel's grad_hint: the loss's gradient at the batch's (fp32) log-probs, whatever
    they are, bitwise (the same autograd ops), in every aggregation mode."""
    lp, _, _, adv, _, mask = _batch(4, b=8, t=6)
    kw = dict(loss_agg_mode=mode, global_num_tokens=int(mask.sum()) + 3, global_num_seqs=11)
    want = lp.float().clone().requires_grad_()
    remax_loss(want, adv.float(), mask.float(), **kw)[0].backward()
    got = logprob_gradient(adv.float(), mask.float(), **kw)
    assert got.abs().max() > 0 and torch.equal(got, want.grad)


@pytest.mark.parametrize(
    "kw,arg",
    [
        (dict(loss_agg_mode="sum"), "loss_agg_mode"),
        (dict(kl_estimator="k9"), "kl_estimator"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(mask=torch.ones(8, 4)), "mask"),
        (dict(old_logprobs=torch.zeros(8)), "old_logprobs"),
        (dict(ref_logprobs=torch.zeros(2, 5)), "ref_logprobs"),
        (dict(clip_eps=1.5), "clip_eps"),
        (dict(global_num_tokens=0), "global_num_tokens"),
    ],
)
def test_bad_input_names_the_argument(kw, arg):
    lp, _, _, adv, _, mask = _batch()
    args = dict(logprobs=lp, advantages=adv, mask=mask)
    args.update(kw)
    with pytest.raises(ValueError) as err:
        remax_loss(**args)
    assert str(err.value).startswith(arg + ":") and "\n" not in str(err.value)
