"""KL estimators match their formulas."""

import math

import pytest
import torch

from remax_megatron.algo import kl_estimate


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_formula(kind):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 5
    got = kl_estimate(lp, ref, kind)
    for i in range(4):
        for j in range(7):
            d = float(lp[i, j] - ref[i, j])
            want = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[kind]
            assert abs(float(got[i, j]) - want) < 1e-12


def test_k2_k3_nonnegative_and_zero_at_equality():
    lp = torch.linspace(-8, 0, 50, dtype=torch.float64)
    for kind in ("k2", "k3"):
        assert bool((kl_estimate(lp, lp.flip(0), kind) >= 0).all())
        assert bool((kl_estimate(lp, lp, kind) == 0).all())


def test_k3_gradient_and_overflow_guard():
    lp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.5], dtype=torch.float64)
    kl_estimate(lp, ref, "k3").sum().backward()
    d = (lp - ref).detach()
    torch.testing.assert_close(lp.grad, 1 - torch.exp(-d))  # d/dlogp [e^-d + d - 1]
    big = kl_estimate(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert bool(torch.isfinite(big).all())


@pytest.mark.parametrize(
    "kind,args,arg", [("k4", None, "kl_estimator"), ("k1", (torch.zeros(3), torch.zeros(4)), "ref_logprobs")]
)
def test_bad_input(kind, args, arg):
    a, b = args or (torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=f"^{arg}:"):
        kl_estimate(a, b, kind)
