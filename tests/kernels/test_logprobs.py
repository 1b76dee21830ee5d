"""fused_logprobs (chunked torch path) against the fp64 contract."""

import pytest
import torch

from remax_megatron.kernels import fused_logprobs, fused_logprobs_reference
from tests.kernels.cases import CASES, check_parity, make_inputs, oracle, run_fused


@pytest.mark.parametrize("chunk", [None, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_fp64_oracle(case, dtype, chunk):
    check_parity(case, dtype, impl="torch", chunk_elems=chunk)


def _count_recomputes(monkeypatch) -> list:
    """Calls of the torch backend's backward (the logit tiles recomputed), counted."""
    from remax_megatron.kernels.logprobs_torch import TorchBackend

    calls, original = [], TorchBackend.backward_grads
    monkeypatch.setattr(
        TorchBackend, "backward_grads", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    return calls


@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_taken_in_the_forward_matches_the_oracle(case, dtype, chunk, monkeypatch):
    """A loss linear in the log-probs, its gradient given in advance (times 0.5: the backward finds
    the scalar 2): the oracle's gradients, and the logit tiles are never recomputed."""
    recomputes = _count_recomputes(monkeypatch)
    check_parity(case, dtype, impl="torch", chunk_elems=chunk, entropy_grad=False, grad_hint=lambda g_lp: g_lp * 0.5)
    assert recomputes == []


@pytest.mark.parametrize("labelled", ["some", "none"])
def test_gradient_in_the_forward_writes_every_element(labelled, monkeypatch):
    """The hint path fills its buffers from torch.empty (the weight grad included: its first row tile
    writes, the rest add): with torch.empty poisoned by NaN the result is still the oracle's, also
    when no row has a label (all-zero grads)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    h, w, labels, temp, g_lp, _ = make_inputs("ignored_rows")
    if labelled == "none":
        labels = torch.full_like(labels, -100)
    recomputes = _count_recomputes(monkeypatch)
    lp, _, gh, gw = run_fused(h, w, labels, temp, g_lp, None, impl="torch", chunk_elems=64, grad_hint=g_lp)
    rlp, _, rh, rw, _ = oracle(h, w, labels, temp)
    (rlp * g_lp).sum().backward()
    assert recomputes == []
    torch.testing.assert_close(lp, rlp.to(lp.dtype))
    torch.testing.assert_close(gh, rh.grad.to(gh.dtype))
    torch.testing.assert_close(gw, rw.grad.to(gw.dtype))


@pytest.mark.parametrize("what", ["other_gradient", "entropy_in_the_loss"])
def test_a_wrong_hint_recomputes_and_stays_exact(what, monkeypatch):
    """The gradient that arrives is not a multiple of the hint (or the entropy has a gradient): the
    backward recomputes, and the result is still the oracle's."""
    recomputes = _count_recomputes(monkeypatch)
    if what == "other_gradient":
        check_parity(
            "ignored_rows",
            impl="torch",
            chunk_elems=64,
            entropy_grad=False,
            grad_hint=lambda g_lp: g_lp + torch.linspace(0, 1e-3, g_lp.numel(), dtype=g_lp.dtype),
        )
    else:
        check_parity("ignored_rows", impl="torch", chunk_elems=64, grad_hint=lambda g_lp: g_lp)
    assert recomputes == [1]


# the default tile / tiles of 64 elements (grad_hint: several row tiles; recompute: several vocab chunks)
@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("path", ["recompute", "grad_hint"])
def test_bf16_inputs_fp32_logits_bf16_gradient_gemms(path, chunk):
    """bf16 inputs: log-probs and entropy from fp32 logits (fp32-exact), gradients from bf16 GEMMs
    (the tile's gradient rounded to bf16, fp32 accumulation), returned in bf16."""
    h, w, labels, temp, g_lp, g_ent = make_inputs("temperature", torch.bfloat16)
    if path == "grad_hint":  # the loss on the log-probs only
        g_ent = torch.zeros_like(g_ent)
        kw = dict(grad_hint=g_lp)
    else:
        kw = {}
    lp, ent, gh, gw = run_fused(h, w, labels, temp, g_lp, None if kw else g_ent, impl="torch", chunk_elems=chunk, **kw)
    assert lp.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    rlp, rent, rh, rw, big = oracle(h, w, labels, temp)  # fp64 on the bf16-rounded inputs
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    assert (lp.double() - rlp).abs().max() < 1e-5 * max(1.0, big)
    assert (ent.double() - rent).abs().max() < 1e-5 * max(1.0, big)
    # bf16 GEMM operands and results: 8 mantissa bits
    assert (gh.double() - rh.grad).abs().max() < 1e-2 * rh.grad.abs().max()
    assert (gw.double() - rw.grad).abs().max() < 1e-2 * rw.grad.abs().max()


def test_reference_matches_oracle():
    h, w, labels, temp, _, _ = make_inputs("ignored_rows")
    lp, ent = fused_logprobs_reference(h, w, labels, temperature=temp, with_entropy=True)
    rlp, rent, *_ = oracle(h, w, labels, temp)
    torch.testing.assert_close(lp, rlp)
    torch.testing.assert_close(ent, rent)


def test_all_negative_logits_never_positive():
    # the shipped bug: a running max started at 0 gives positive log-probs here
    h = torch.ones(4, 2)
    w = torch.full((50, 2), -600.0)
    w[:, 1] += torch.linspace(0, 1, 50)
    lp, ent = fused_logprobs(h, w, torch.arange(4), with_entropy=True, chunk_elems=16)
    assert bool((lp <= 0).all()) and bool(torch.isfinite(lp).all())
    assert bool((ent >= 0).all()) and bool((ent <= torch.log(torch.tensor(50.0))).all())
    rlp, rent = fused_logprobs_reference(h.double(), w.double(), torch.arange(4), with_entropy=True)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-4, rtol=0)


def test_logprobs_only_and_entropy_none():
    h, w, labels, temp, g_lp, _ = make_inputs("basic")
    h.requires_grad_()
    lp, ent = fused_logprobs(h, w, labels, temperature=temp)
    assert ent is None
    (lp * g_lp).sum().backward()
    rlp, _, rh, _, _ = oracle(h, w, labels, temp)
    (rlp * g_lp).sum().backward()
    torch.testing.assert_close(h.grad, rh.grad)


def test_nothing_of_size_tokens_by_vocab_is_saved():
    n, d, v = 16, 8, 512
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        lp, ent = fused_logprobs(h, w, torch.randint(0, v, (n,)), with_entropy=True, chunk_elems=1024)
    assert max(sizes) < n * v, sizes
    (lp.sum() + ent.sum()).backward()


def test_ignored_rows_never_reach_the_output_layer(monkeypatch):
    """Prompt and padding positions (label -100) cost no logits: the backend's GEMMs see only the
    labelled rows, forward and backward, and the result (zeros there, grads included) is the oracle's."""
    from remax_megatron.kernels.logprobs_torch import TorchBackend

    seen = []
    for name in ("forward_stats", "backward_grads"):
        original = getattr(TorchBackend, name)
        monkeypatch.setattr(
            TorchBackend,
            name,
            lambda self, x, *a, _f=original, _n=name, **k: seen.append((_n, x.shape[0])) or _f(self, x, *a, **k),
        )
    h, w, labels, temp, g_lp, g_ent = make_inputs("ignored_rows")
    labelled = int((labels != -100).sum())
    assert 0 < labelled < labels.numel()
    lp, ent, gh, gw = run_fused(h, w, labels, temp, g_lp, g_ent, impl="torch", chunk_elems=64)
    assert seen == [("forward_stats", labelled), ("backward_grads", labelled)]
    rlp, rent, rh, rw, _ = oracle(h, w, labels, temp)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    ignored = labels == -100
    assert lp[ignored].abs().max() == 0 and ent[ignored].abs().max() == 0 and gh[ignored].abs().max() == 0
    torch.testing.assert_close(lp.double(), rlp)
    torch.testing.assert_close(ent.double(), rent)
    torch.testing.assert_close(gh.double(), rh.grad)
    torch.testing.assert_close(gw.double(), rw.grad)


def test_valid_vocab_drops_padding_rows():
    h, w, labels, temp, g_lp, g_ent = make_inputs("basic")
    keep = 90
    labels = labels.clamp(max=keep - 1)
    lp, ent, gh, gw = run_fused(h, w, labels, temp, g_lp, g_ent, valid_vocab=keep)
    rlp, rent, rh, rw, _ = oracle(h, w[:keep], labels, temp)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    torch.testing.assert_close(lp, rlp)
    torch.testing.assert_close(ent, rent)
    torch.testing.assert_close(gw[:keep], rw.grad)
    assert bool((gw[keep:] == 0).all())


def test_grad_hint_of_the_wrong_shape_is_refused():
    h, w, labels, *_ = make_inputs("basic")
    with pytest.raises(ValueError, match="^grad_hint: shape"):
        fused_logprobs(h, w, labels, grad_hint=torch.ones(labels.numel() + 1, dtype=h.dtype))


def _good():
    return torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, -100, 9])


@pytest.mark.parametrize(
    "mutate,arg",
    [
        (lambda h, w, y, kw: (h[None], w, y, kw), "hidden"),
        (lambda h, w, y, kw: (h, w[:, :5], y, kw), "weight"),
        (lambda h, w, y, kw: (h, w.double(), y, kw), "weight"),
        (lambda h, w, y, kw: (h, w, y[:3], kw), "labels"),
        (lambda h, w, y, kw: (h, w, y.float(), kw), "labels"),
        (lambda h, w, y, kw: (h, w, torch.tensor([1, 2, 10, 0]), kw), "labels"),
        (lambda h, w, y, kw: (h, w, torch.tensor([1, -5, 3, 0]), kw), "labels"),
        (lambda h, w, y, kw: (h, w, y, dict(temperature=0.0)), "temperature"),
        (lambda h, w, y, kw: (h, w, y, dict(temperature=-1.0)), "temperature"),
        (lambda h, w, y, kw: (h, w, y, dict(impl="cuda-magic")), "impl"),
        (lambda h, w, y, kw: (h, w, y, dict(valid_vocab=11)), "valid_vocab"),
    ],
)
@pytest.mark.parametrize("fn", [fused_logprobs, fused_logprobs_reference])
def test_bad_input_names_the_argument(fn, mutate, arg):
    if fn is fused_logprobs_reference and arg == "impl":
        return  # the reference has one implementation and ignores impl
    h, w, y, kw = mutate(*_good(), {})
    with pytest.raises(ValueError) as err:
        fn(h, w, y, **kw)
    msg = str(err.value)
    assert msg.startswith(arg + ":") and "\n" not in msg, msg


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, y = _good()
    with pytest.raises(ValueError, match="^impl:"):
        fused_logprobs(h, w, y, impl="triton")


@pytest.mark.parametrize("path", ["recompute", "grad_hint"])
def test_bf16_weight_grad_sums_row_tiles_in_fp32(path):
    """600 equal rows in row tiles of 1 (grad_hint) or 8 (recompute): the label's weight-grad row is
    a sum of 600 or 75 equal bf16 GEMM results. Summed in fp32 it is off by bf16's output rounding only
    (< 2^-8 of the largest entry); summed in bf16 it was off by 20%."""
    torch.manual_seed(0)
    n, v, d = 600, 40, 16
    h = torch.randn(1, d).repeat(n, 1).to(torch.bfloat16)
    w = (torch.randn(v, d) * 0.3).to(torch.bfloat16)
    labels = torch.full((n,), 3)
    g = torch.ones(n, dtype=torch.float64)
    kw = dict(grad_hint=g.float()) if path == "grad_hint" else {}
    _, _, _, gw = run_fused(h, w, labels, 1.0, g, None, impl="torch", chunk_elems=8, **kw)
    rlp, _, _, rw, _ = oracle(h, w, labels, 1.0)
    rlp.sum().backward()
    assert (gw.double() - rw.grad).abs().max() < 2**-8 * rw.grad.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("labelled", ["some", "none"])
def test_recomputed_gradient_writes_every_element(labelled, dtype, monkeypatch):
    """The recompute path's weight grad comes from torch.empty too (every vocab chunk's first row tile
    writes): with torch.empty poisoned by NaN the grads are still the oracle's."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    h, w, labels, temp, g_lp, g_ent = make_inputs("ignored_rows", dtype)
    if labelled == "none":
        labels = torch.full_like(labels, -100)
    _, _, gh, gw = run_fused(h, w, labels, temp, g_lp, g_ent, impl="torch", chunk_elems=64)
    rlp, rent, rh, rw, _ = oracle(h, w, labels, temp)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert bool(torch.isfinite(gw).all()) and bool(torch.isfinite(gh).all())
    assert (gw.double() - rw.grad).abs().max() <= tol * max(rw.grad.abs().max().item(), 1e-30)
    assert (gh.double() - rh.grad).abs().max() <= tol * max(rh.grad.abs().max().item(), 1e-30)


def test_fp16_hint_keeps_gradients_below_fp16_range():
    """fp16 under megatron's loss scale (65536, arriving as the backward's factor on the hint): the
    unscaled tile gradient g p is ~2.5e-8 here, which fp16 (smallest subnormal 6e-8) flushes to zero,
    so the gradient GEMMs of fp16 inputs run in fp32 and only the scaled result is cast."""
    torch.manual_seed(0)
    n, v, d = 8, 4000, 16
    h, w = (torch.randn(n, d) * 0.1).half(), (torch.randn(v, d) * 0.1).half()
    labels = torch.randint(0, v, (n,))
    g, loss_scale = torch.full((n,), 1e-4, dtype=torch.float64), 65536.0
    _, _, _, gw = run_fused(h, w, labels, 1.0, g * loss_scale, None, impl="torch", grad_hint=g.float())
    rlp, _, _, rw, _ = oracle(h, w, labels, 1.0)
    (rlp * g * loss_scale).sum().backward()
    others = torch.ones(v, dtype=torch.bool)
    others[labels] = False  # the rows of tokens no row is labelled with: -g p h, all tiny
    want = rw.grad[others]
    assert (gw.double()[others] - want).abs().max() < 1e-2 * want.abs().max()
