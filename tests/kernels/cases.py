"""Shared parity cases for the log-prob kernels (torch path, Triton interpreter).

``check_parity(impl, case)`` runs ``fused_logprobs`` and the fp64 contract
``log_softmax(h @ W.T / T)`` gathered, and asserts logprobs/entropy within
1e-5 (relative to the largest |logit| when that exceeds 1) and grads w.r.t.
hidden and weight within 1e-4 relative (to the largest grad entry). For fp32
inputs the grad tolerance is at least three times the error of the naive fp32 path
(full logits, log_softmax) on the same inputs: fp32 cannot do better.
"""

import torch

from remax_megatron.kernels import fused_logprobs

# name -> (N, D, V, logit_shift, logit_scale, temperature, n_ignored)
CASES = {
    "basic": (13, 24, 100, 0.0, 1.0, 1.0, 0),
    "temperature": (13, 24, 100, 0.0, 2.0, 0.6, 0),
    "ignored_rows": (13, 24, 100, 0.0, 1.0, 1.0, 4),
    "single_token": (1, 24, 100, 0.0, 1.0, 1.0, 0),
    "odd_vocab": (7, 20, 97, 0.0, 1.0, 1.3, 1),
    "all_negative_-1000": (9, 16, 67, -1000.0, 1.0, 1.0, 0),
    "huge_1e4": (9, 16, 67, 0.0, 1e4, 1.0, 0),
}


def make_inputs(case, dtype=torch.float64, seed=0):
    """hidden, weight with a constant column so logits = h @ W.T carry the shift."""
    n, d, v, shift, scale, temp, n_ign = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64) / d**0.5 * 3
    w = torch.randn(v, d, generator=gen, dtype=torch.float64)
    # the last hidden feature is 1 and the weight's last column is the shift,
    # so every logit is shifted by `shift` (all near -1000 for the -1000 case)
    h[:, -1] = 1.0
    w[:, -1] = shift + w[:, -1] * 0.1
    h = h * scale**0.5
    w = w * scale**0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[:n_ign] = -100
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)
    return h.to(dtype), w.to(dtype), labels, temp, g_lp, g_ent


def oracle(h, w, labels, temp):
    """fp64 logprobs, entropy and grads of sum(g_lp*lp + g_ent*ent)."""
    h = h.double().detach().requires_grad_()
    w = w.double().detach().requires_grad_()
    logits = h @ w.T / temp
    logsm = torch.log_softmax(logits, -1)
    valid = labels != -100
    lp = logsm.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * valid
    ent = -(logsm.exp() * logsm).sum(-1) * valid
    return lp, ent, h, w, logits.detach().abs().max().item()


def run_fused(h, w, labels, temp, g_lp, g_ent, **kw):
    """Grads of sum(g_lp * lp + g_ent * ent); g_ent None: the entropy is not in the loss."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp, ent = fused_logprobs(h, w, labels, temperature=temp, with_entropy=True, **kw)
    loss = (lp.double() * g_lp).sum()
    if g_ent is not None:
        loss = loss + (ent.double() * g_ent).sum()
    loss.backward()
    return lp, ent, h.grad, w.grad


def check_parity(case, dtype=torch.float64, lp_tol=1e-5, grad_tol=1e-4, entropy_grad=True, **kw):
    """``entropy_grad=False``: the loss holds the log-probs only (what a ``grad_hint`` is for)."""
    h, w, labels, temp, g_lp, g_ent = make_inputs(case, dtype)
    if not entropy_grad:
        g_ent = torch.zeros_like(g_ent)
    if callable(kw.get("grad_hint")):
        kw["grad_hint"] = kw["grad_hint"](g_lp)
    lp, ent, gh, gw = run_fused(h, w, labels, temp, g_lp, g_ent if entropy_grad else None, **kw)
    rlp, rent, rh, rw, big = oracle(h, w, labels, temp)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    tol = lp_tol * max(1.0, big)
    v = w.shape[0]
    _close("logprobs", lp, rlp, tol)
    _close("entropy", ent, rent, tol)
    assert bool((lp <= 0).all()), f"positive logprob {lp.max().item()}"
    assert bool((ent >= 0).all()) and bool((ent <= torch.log(torch.tensor(float(v))) + 1e-6).all())
    assert bool((lp[labels == -100] == 0).all()) and bool((ent[labels == -100] == 0).all())
    floor_h = floor_w = 0.0
    if dtype != torch.float64:
        # fp32 logits near -1000 carry ~6e-5 absolute rounding, so grads through
        # the shared offset cancel: allow what the naive fp32 path itself gets
        nh, nw = _naive_grads(h, w, labels, temp, g_lp, g_ent)
        floor_h = 3 * (nh - rh.grad).abs().max().item()
        floor_w = 3 * (nw - rw.grad).abs().max().item()
    _close("grad_hidden", gh, rh.grad, max(floor_h, grad_tol * max(1e-30, rh.grad.abs().max().item())))
    _close("grad_weight", gw, rw.grad, max(floor_w, grad_tol * max(1e-30, rw.grad.abs().max().item())))


def _naive_grads(h, w, labels, temp, g_lp, g_ent):
    """Grads of the unfused fp32 path (full logits), as float64."""
    h = h.float().detach().requires_grad_()
    w = w.float().detach().requires_grad_()
    logsm = torch.log_softmax(h @ w.T / temp, -1)
    valid = labels != -100
    lp = logsm.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * valid
    ent = -(logsm.exp() * logsm).sum(-1) * valid
    ((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum()).backward()
    return h.grad.double(), w.grad.double()


def _close(name, got, want, tol):
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, f"{name}: max abs err {err:.3g} > tol {tol:.3g}"
