"""Counts the GEMM work of one ``fused_logprobs`` forward + backward on the Triton backend.

A GEMM pass is ``2 N V D`` FLOPs (the logits of every labelled row over the vocab shard, or one
of the two gradient products), whatever the tiling. Two kinds of work are counted:

- Triton launches of the kernels that run ``tl.dot`` (``_fwd_stats`` and ``_bwd_dlogits``): each
  launch covers ``rows x cols`` logits over ``D``, read from its arguments, ``2 rows cols D`` FLOPs;
- torch's GEMMs (``dz @ W``, ``dz.T @ x``), by ``torch.utils.flop_counter.FlopCounterMode`` (plus a
  formula for the in-place ``addmm_`` it lacks).

Launches are counted per kernel name too (the elementwise ``_hint_dlogits_kernel`` has no dot).
"""

from collections import Counter

import torch

from remax_megatron.kernels import fused_logprobs

# kernel attribute -> positions of (rows, cols, D) among its launch arguments
_DOT_KERNELS = {"_fwd_stats": (5, 6, 7), "_bwd_dlogits": (9, 10, 11)}


def _addmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    """``out.addmm_(a, b)`` (a row tile's weight gradient added in place): FlopCounterMode has no
    formula for the in-place op and would count 0."""
    from torch.utils.flop_counter import mm_flop

    return mm_flop(a_shape, b_shape)


class _CountingLaunch:
    def __init__(self, kernel, name, dims, log):
        self.kernel, self.name, self.dims, self.log = kernel, name, dims, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            flops = 2 * args[self.dims[0]] * args[self.dims[1]] * args[self.dims[2]] if self.dims else 0
            self.log.append((self.name, flops))
            return self.kernel[grid](*args, **kwargs)

        return launch


def count_gemm_passes(h, w, labels, grad_lp, *, grad_hint=None, chunk_elems=None, temperature=1.0):
    """(GEMM passes, launches per kernel name) of forward + backward of ``sum(grad_lp * logprobs)``."""
    from torch.utils.flop_counter import FlopCounterMode

    import remax_megatron.kernels.logprobs_triton as lt

    log = []
    originals = {name: getattr(lt, name) for name in (*_DOT_KERNELS, "_hint_dlogits_kernel")}
    try:
        for name, kernel in originals.items():
            setattr(lt, name, _CountingLaunch(kernel, name, _DOT_KERNELS.get(name), log))
        h = h.detach().clone().requires_grad_()
        w = w.detach().clone().requires_grad_()
        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_inplace_flops}) as counter:
            lp, _ = fused_logprobs(
                h, w, labels, temperature=temperature, impl="triton", grad_hint=grad_hint, chunk_elems=chunk_elems
            )
            (lp.double() * grad_lp).sum().backward()
    finally:
        for name, kernel in originals.items():
            setattr(lt, name, kernel)
    labelled = int((labels != -100).sum())
    one_pass = 2 * labelled * w.shape[0] * w.shape[1]
    total = sum(f for _, f in log) + counter.get_total_flops()
    return total / one_pass, Counter(name for name, _ in log)


def hint_and_recompute_passes(device="cpu", chunk_elems=None):
    """GEMM passes of the hinted and the plain backward on a small labelled batch (with ignored rows)."""
    gen = torch.Generator().manual_seed(3)
    n, d, v = 13, 24, 100
    h = torch.randn(n, d, generator=gen).to(device)
    w = torch.randn(v, d, generator=gen).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    labels[:3] = -100
    g = torch.randn(n, generator=gen, dtype=torch.float64).to(device)
    hinted = count_gemm_passes(h, w, labels, g, grad_hint=g * 0.25, chunk_elems=chunk_elems)
    plain = count_gemm_passes(h, w, labels, g, chunk_elems=chunk_elems)
    return hinted, plain
