"""compute_advantages against a hand-written fp64 loop."""

import pytest
import torch

from remax_megatron.kernels import compute_advantages, compute_advantages_reference


def _loop(r, rb, mask, lp, ref, coef, clip):
    b, t = mask.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            total = float(r[i]) - float(rb[i])
            for k in range(j, t):
                if mask[i, k] and lp is not None:
                    total += -coef * (float(lp[i, k]) - float(ref[i, k]))
            if clip is not None:
                total = max(-clip, min(clip, total))
            out[i, j] = total
    return out


def _inputs(seed=0, b=6, t=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, :5] = True  # left-aligned response
    mask[1, 3:] = True  # right-aligned (prompt first)
    mask[2, 4] = True  # response of length 1
    # row 3: fully masked
    mask[4] = torch.rand(t, generator=g) > 0.4  # holes
    mask[5] = True
    r = torch.randn(b, generator=g, dtype=torch.float64)
    rb = torch.randn(b, generator=g, dtype=torch.float64)
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    return r, rb, mask, lp, ref


@pytest.mark.parametrize("coef,clip", [(0.0, None), (0.05, None), (0.5, None), (0.2, 0.7)])
@pytest.mark.parametrize("fn", [compute_advantages, compute_advantages_reference])
def test_matches_fp64_loop(fn, coef, clip):
    r, rb, mask, lp, ref = _inputs()
    got = fn(r, rb, mask, lp, ref, kl_coef=coef, clip=clip)
    want = _loop(r, rb, mask, lp if coef else None, ref, coef, clip)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert bool((got[3] == 0).all())  # fully masked row


def test_without_kl_is_reward_minus_greedy_broadcast():
    r, rb, mask, lp, ref = _inputs(seed=3)
    for kw in (dict(), dict(kl_coef=0.0, logprobs=lp, ref_logprobs=ref), dict(kl_coef=0.3)):
        adv = compute_advantages(r, rb, mask, **kw)
        torch.testing.assert_close(adv, (r - rb)[:, None] * mask)


def test_float_mask_and_fp32():
    r, rb, mask, lp, ref = _inputs(seed=4)
    adv = compute_advantages(r.float(), rb.float(), mask.float(), lp.float(), ref.float(), kl_coef=0.1)
    assert adv.dtype == torch.float32
    want = _loop(r, rb, mask, lp, ref, 0.1, None)
    torch.testing.assert_close(adv.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kw,arg",
    [
        (dict(rewards=torch.zeros(5)), "rewards"),
        (dict(baseline=torch.zeros(6, 1)), "baseline"),
        (dict(mask=torch.ones(6)), "mask"),
        (dict(logprobs=torch.zeros(6, 8)), "logprobs"),
        (dict(ref_logprobs=torch.zeros(3, 9)), "ref_logprobs"),
        (dict(clip=0.0), "clip"),
        (dict(clip=-1.0), "clip"),
        (dict(impl="magic"), "impl"),
    ],
)
def test_bad_input_names_the_argument(kw, arg):
    r, rb, mask, lp, ref = _inputs()
    args = dict(rewards=r, baseline=rb, mask=mask, logprobs=lp, ref_logprobs=ref, kl_coef=0.1)
    args.update(kw)
    with pytest.raises(ValueError) as err:
        compute_advantages(**args)
    assert str(err.value).startswith(arg + ":") and "\n" not in str(err.value)


def test_triton_preference_only_where_triton_runs(monkeypatch):
    """REMAX_KERNEL_IMPL=triton covers CUDA tensors; the trainer's CPU advantages stay on torch, and an
    explicit impl='triton' on CPU (no interpreter) is refused by name."""
    g = torch.Generator().manual_seed(0)
    r, rb = torch.randn(3, generator=g), torch.randn(3, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("REMAX_KERNEL_IMPL", "triton")
    torch.testing.assert_close(compute_advantages(r, rb, mask), compute_advantages_reference(r, rb, mask))
    with pytest.raises(ValueError, match="impl: 'triton' needs CUDA tensors"):
        compute_advantages(r, rb, mask, impl="triton")
