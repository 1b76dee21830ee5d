"""fused_logprobs under tensor parallelism (gloo, 2 and 4 ranks, uneven last shard)
equals the unsharded result: forward on every rank, grad of hidden on every rank
(all-reduced in backward), and the reassembled per-rank weight grads; also with the
gradient taken in the forward (grad_hint)."""

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed


def _shards(v, world):
    """Megatron-style: equal shards of ceil(v / world), the last one smaller."""
    per = -(-v // world)
    sizes = [min(per, v - r * per) for r in range(world)]
    assert all(s > 0 for s in sizes) and sizes[-1] < per, sizes
    return sizes


def _body(rank, world, v):
    from remax_megatron.kernels import fused_logprobs, fused_logprobs_reference

    torch.manual_seed(0)
    n, d = 11, 12
    h = torch.randn(n, d, dtype=torch.float64) * 2
    w = torch.randn(v, d, dtype=torch.float64)
    labels = torch.randint(0, v, (n,))
    labels[[0, 5]] = -100
    labels[1] = v - 1  # a target in the short last shard
    g_lp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    sizes = _shards(v, world)
    lo = sum(sizes[:rank])
    group = dist.new_group(list(range(world)))

    def run(fn, hid, wt, tp_group, **kw):
        hid = hid.clone().requires_grad_()
        wt = wt.clone().requires_grad_()
        lp, ent = fn(hid, wt, labels, temperature=0.8, tp_group=tp_group, with_entropy=True, **kw)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp, ent, hid.grad, wt.grad

    full = run(fused_logprobs_reference, h, w, None)
    shard = w[lo : lo + sizes[rank]]
    for fn, kw in ((fused_logprobs, dict(chunk_elems=16)), (fused_logprobs, {}), (fused_logprobs_reference, {})):
        lp, ent, gh, gw = run(fn, h, shard, group, **kw)
        torch.testing.assert_close(lp, full[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(ent, full[1], rtol=0, atol=1e-10)
        torch.testing.assert_close(gh, full[2], rtol=0, atol=1e-10)  # every rank: full grad
        parts = [torch.zeros(max(sizes), d, dtype=torch.float64) for _ in range(world)]
        pad = torch.zeros(max(sizes), d, dtype=torch.float64)
        pad[: sizes[rank]] = gw
        dist.all_gather(parts, pad, group=group)
        whole = torch.cat([p[:s] for p, s in zip(parts, sizes)])
        torch.testing.assert_close(whole, full[3], rtol=0, atol=1e-10)

    # the gradient taken in the forward (grad_hint; loss on the log-probs only): one merge per row
    # tile on every rank (chunk 16 < the vocab: 11 one-row tiles), no recomputation, unsharded grads
    from remax_megatron.kernels.logprobs_torch import TorchBackend

    def lp_only(fn, wt, tp_group, **kw):
        hid, wt = h.clone().requires_grad_(), wt.clone().requires_grad_()
        lp, _ = fn(hid, wt, labels, temperature=0.8, tp_group=tp_group, **kw)
        (lp * g_lp).sum().backward()
        return lp, hid.grad, wt.grad

    want = lp_only(fused_logprobs_reference, w, None)
    recompute = TorchBackend.backward_grads
    TorchBackend.backward_grads = None  # must not be called
    try:
        for kw in (dict(chunk_elems=16), {}):
            lp, gh, gw = lp_only(fused_logprobs, shard, group, grad_hint=g_lp * 4, **kw)
            torch.testing.assert_close(lp, want[0], rtol=0, atol=1e-10)
            torch.testing.assert_close(gh, want[1], rtol=0, atol=1e-10)
            torch.testing.assert_close(gw, want[2][lo : lo + sizes[rank]], rtol=0, atol=1e-10)
    finally:
        TorchBackend.backward_grads = recompute

    # fp32 shards, logits near -1000: still <= 0 and equal to the unsharded fp32 run
    hn, wn = torch.ones(n, 2), torch.full((v, 2), -500.0)
    wn[:, 1] += torch.linspace(0, 1, v)
    lp_tp, _ = fused_logprobs(hn, wn[lo : lo + sizes[rank]], labels, tp_group=group)
    lp_1, _ = fused_logprobs(hn, wn, labels)
    assert bool((lp_tp <= 0).all())
    torch.testing.assert_close(lp_tp, lp_1, rtol=0, atol=1e-4)

    # megatron vocab padding on the last rank: ids >= valid are not in the softmax
    valid = v - 2
    lab_ok = labels.clamp(max=valid - 1)
    lp_tp, ent_tp = fused_logprobs(h, shard, lab_ok, tp_group=group, with_entropy=True, valid_vocab=valid)
    lp_1, ent_1 = fused_logprobs_reference(h, w[:valid], lab_ok, with_entropy=True)
    torch.testing.assert_close(lp_tp, lp_1, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_tp, ent_1, rtol=0, atol=1e-10)


@pytest.mark.parametrize("world,vocab", [(2, 37), pytest.param(4, 37, marks=pytest.mark.slow)])
def test_tp_equals_unsharded(world, vocab):
    run_distributed(_body, world_size=world, args=(vocab,))
