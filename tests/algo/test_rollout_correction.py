"""algo.rollout_correction: the importance weights of the engine/trainer mismatch, against fp64 references.

The trainer-level checks (every layout, packed rows, the is/* metrics over DP) are in
tests/train/test_rollout_correction.py.
"""

import math

import pytest
import torch

from remax_megatron.algo.rollout_correction import correction_metrics, correction_weights
from remax_megatron.config import load_config
from remax_megatron.kernels import remax_loss


def _logprobs(seed=0, rows=4, width=10):
    g = torch.Generator().manual_seed(seed)
    actor = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3  # [B, T]
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i in range(rows):
        mask[i, 2 : 3 + 2 * i] = True  # 1, 3, 5, 7 tokens
    return actor, mask


def test_token_tis_weights_are_the_capped_ratio():
    """min(exp(actor - engine), cap) on response tokens (fp64 reference), 0 elsewhere; no gradient."""
    actor, mask = _logprobs()
    engine = actor + torch.randn(actor.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.5
    w, stats = correction_weights(actor.float().requires_grad_(), engine.float(), mask, "token-tis", 1.3)
    ref = torch.where(mask, torch.exp(actor - engine).clamp(max=1.3), 0.0)
    assert not w.requires_grad
    assert torch.allclose(w.double(), ref, atol=1e-6, rtol=1e-6)
    raw = torch.exp(actor - engine)[mask]
    assert stats["ratio_count"].item() == mask.sum().item()
    assert stats["ratio_sum"].item() == pytest.approx(raw.sum().item(), rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(raw.max().item(), rel=1e-6)
    assert stats["corrected"].item() == (raw > 1.3).sum().item() > 0


def test_one_shifted_sequence_is_capped_or_masked_and_counted_exactly():
    """Issue 36: the engine's log-probs of one sequence moved by 0.5 (every other token exact).
    token-tis (cap 1.5): that sequence's tokens (engine 0.5 below the actor: ratio e^0.5 = 1.65) get
    weight 1.5, the others 1, and exactly its tokens are counted as clipped. seq-mis: a move of 0.5
    either way (ratio e^0.5 or e^-0.5, outside [1/1.5, 1.5]) masks that sequence alone."""
    actor, mask = _logprobs()
    shifted = 2
    for sign, mode in ((-1, "token-tis"), (-1, "seq-mis"), (+1, "seq-mis")):
        engine = actor.clone()
        engine[shifted] += sign * 0.5
        w, stats = correction_weights(actor, engine, mask, mode, 1.5)
        expected = mask.double()
        expected[shifted] *= 1.5 if mode == "token-tis" else 0.0
        assert torch.equal(w.double(), expected), (sign, mode)
        metrics = correction_metrics({k: v.item() for k, v in stats.items()}, mode)
        if mode == "token-tis":
            assert metrics["is/clipped_frac"] == mask[shifted].sum().item() / mask.sum().item()
            assert metrics["is/ratio_max"] == pytest.approx(math.exp(0.5))
        else:
            assert metrics["is/masked_frac"] == 1 / 4
            assert metrics["is/ratio_max"] == pytest.approx(math.exp(0.5) if sign < 0 else 1.0)


def test_sequence_ratio_of_a_long_sequence_does_not_underflow():
    """NeMo-RL #2269: 4000 tokens each 0.01 below the engine. The geometric mean ratio is 0.99 (kept
    by seq-mis at cap 2); exp of the summed log-ratios would be e^-40 (masked)."""
    actor = torch.full((1, 4000), -1.0)
    engine = actor + 0.01
    mask = torch.ones(1, 4000, dtype=torch.bool)
    w, stats = correction_weights(actor, engine, mask, "seq-mis", 2.0)
    assert torch.equal(w, torch.ones(1, 4000))
    assert stats["ratio_sum"].item() == pytest.approx(math.exp(-0.01), rel=1e-5)
    w, _ = correction_weights(actor, engine, mask, "token-tis", 2.0)
    assert torch.allclose(w, torch.full((1, 4000), math.exp(-0.01)), rtol=1e-6)


def test_rows_without_response_tokens_count_for_nothing():
    """A ghost / empty row: weight 0 and no sequence in the counts (no 0/0)."""
    actor, mask = _logprobs()
    mask[1] = False
    _, stats = correction_weights(actor, actor, mask, "seq-mis", 2.0)
    assert stats["ratio_count"].item() == 3 and stats["corrected"].item() == 0
    assert stats["ratio_sum"].item() == pytest.approx(3.0)


def test_loss_weights_the_policy_gradient_term_only():
    """remax_loss with is_weights: pg and its gradient scale per token; weights of 1 change nothing;
    the KL term is not weighted."""
    actor, mask = _logprobs()
    lp = actor.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    w = torch.rand(actor.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    loss, stats = remax_loss(lp, adv, mask, is_weights=w)
    loss.backward()
    m = mask.double()
    assert loss.item() == pytest.approx((-adv[:, None] * w * actor * m).sum().item() / m.sum().item())
    assert torch.allclose(lp.grad, -adv[:, None] * w * m / m.sum())
    plain, _ = remax_loss(actor, adv, mask)
    ones, _ = remax_loss(actor, adv, mask, is_weights=torch.ones_like(actor))
    assert ones.item() == plain.item()
    ref = actor - 0.1
    with_kl, s = remax_loss(actor, adv, mask, is_weights=w, ref_logprobs=ref, kl_coef=0.5, kl_estimator="k1")
    assert with_kl.item() == pytest.approx(loss.item() + 0.5 * 0.1)


def test_config_refusals_are_one_line():
    with pytest.raises(ValueError, match="rollout.top_k=5.*rollout.engine=native"):
        load_config(None, ["reward.functions=[exact_match]", "algo.rollout_correction=token-tis", "rollout.top_k=5"])
    with pytest.raises(ValueError, match="rollout.top_p=0.9"):
        load_config(None, ["reward.functions=[exact_match]", "algo.rollout_correction=seq-mis", "rollout.top_p=0.9"])
    with pytest.raises(ValueError, match="algo.rollout_is_cap=0.5"):
        load_config(None, ["reward.functions=[exact_match]", "algo.rollout_is_cap=0.5"])
    with pytest.raises(ValueError, match="algo.rollout_correction='tis' is not one of none, token-tis, seq-mis"):
        load_config(None, ["reward.functions=[exact_match]", "algo.rollout_correction=tis"])
    # the native engine reports the untruncated log-probs: allowed
    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "algo.rollout_correction=token-tis",
            "rollout.top_k=5",
            "rollout.engine=native",
        ],
    )
    assert cfg.algo.rollout_correction == "token-tis"


def test_one_step_ahead_without_correction_is_warned_once():
    """Issue 36 item 4: separate placement one version behind without a correction: one warning line."""
    base = ["reward.functions=[exact_match]", "rollout.placement=separate", "rollout.ranks=1"]
    (line,) = load_config(None, base).start_warnings()
    assert line.startswith("warning: rollout.max_staleness=1") and "algo.rollout_correction=token-tis" in line
    assert load_config(None, [*base, "algo.rollout_correction=seq-mis"]).start_warnings() == []
    assert load_config(None, [*base, "rollout.max_staleness=0"]).start_warnings() == []
    assert load_config(None, ["reward.functions=[exact_match]"]).start_warnings() == []
