"""Triton kernel of :func:`remax_megatron.kernels.compute_advantages` (CUDA).

One program per sequence walks ``T`` from the end in tiles of ``BLOCK_T``,
carrying the KL sum of the tiles already seen, so a single read of
``logprobs``/``ref_logprobs``/``mask`` and a single write of the advantages
cover the whole reward-to-go. Inside a tile the suffix sum is
``tile_total - inclusive_cumsum + value``. Set ``TRITON_INTERPRET=1`` before
importing this module to run it on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _advantages_kernel(
    R,
    RB,
    LP,
    REF,
    MASK,
    OUT,
    T,
    stride_lp,
    stride_ref,
    stride_m,
    stride_o,
    kl_coef,
    clip,
    HAS_KL: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    base = tl.load(R + b).to(tl.float32) - tl.load(RB + b).to(tl.float32)
    carry = 0.0
    n_tiles = tl.cdiv(T, BLOCK_T)
    for i in range(0, n_tiles):
        offs = (n_tiles - 1 - i) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = offs < T
        mk = tl.load(MASK + b * stride_m + offs, mask=ok, other=0.0)  # [BLOCK_T]
        adv = tl.zeros((BLOCK_T,), dtype=tl.float32) + base
        if HAS_KL:
            lp = tl.load(LP + b * stride_lp + offs, mask=ok, other=0.0).to(tl.float32)
            rf = tl.load(REF + b * stride_ref + offs, mask=ok, other=0.0).to(tl.float32)
            kl = -kl_coef * (lp - rf) * mk  # [BLOCK_T]
            total = tl.sum(kl, axis=0)
            suffix = total - tl.cumsum(kl, axis=0) + kl + carry
            adv += suffix
            carry += total
        adv = adv * mk
        if HAS_CLIP:
            adv = tl.minimum(tl.maximum(adv, -clip), clip)
        tl.store(OUT + b * stride_o + offs, adv, mask=ok)


def advantages_triton(rewards, baseline, mask, logprobs, ref_logprobs, kl_coef, clip, block_t=None):
    """Launch one program per row; inputs already validated by the caller.

    block_t: tile length (a power of 2; default covers T up to 1024 per tile)."""
    b, t = mask.shape
    out = torch.empty(b, t, dtype=torch.float32, device=mask.device)  # [B, T]
    if b == 0 or t == 0:
        return out
    m = mask.to(torch.float32).contiguous()
    has_kl = logprobs is not None and ref_logprobs is not None
    lp = logprobs.contiguous() if has_kl else m
    rf = ref_logprobs.contiguous() if has_kl else m
    block = block_t or min(1024, triton.next_power_of_2(t))
    _advantages_kernel[(b,)](
        rewards.contiguous(),
        baseline.contiguous(),
        lp,
        rf,
        m,
        out,
        t,
        lp.stride(0),
        rf.stride(0),
        m.stride(0),
        out.stride(0),
        float(kl_coef),
        float(clip) if clip is not None else 0.0,
        HAS_KL=has_kl,
        HAS_CLIP=clip is not None,
        BLOCK_T=block,
    )
    return out
