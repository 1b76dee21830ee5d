"""Triton backend of :func:`remax_megatron.kernels.fused_logprobs` (CUDA).

Two kernels, both computing logit tiles ``x[rows] @ w[cols].T`` with an fp32
accumulator (bf16/fp16 tiles feed ``tl.dot`` directly on GPU; under
``TRITON_INTERPRET=1`` they are cast to fp32 first, as the interpreter's bf16
dot is wrong):

- ``_fwd_stats_kernel``: grid ``(row blocks, vocab splits)``. Each program walks
  its split's vocab tiles and keeps the online state ``(m, s, a, t)`` of
  ``logprobs.py`` per row; the ``[splits, N]`` partial states are merged
  exactly in torch (the same merge as across TP ranks). Splitting the vocab
  keeps the GPU busy when there are few row blocks.
- ``_bwd_dlogits_kernel``: for one vocab chunk, recomputes the logit tiles and
  writes the gradient w.r.t. the logits ``dz [N, chunk]`` (``-p (g + h (l -
  E l)) + g 1[j = y]`` times ``1/T``); the two gradient GEMMs
  ``grad_x += dz @ w_chunk`` and ``grad_w_chunk = dz.T @ x`` then run in
  cuBLAS. Only one ``[N, chunk]`` buffer is live, never ``[N, V]``.

Same backend protocol as ``logprobs_torch.TorchBackend``. Block sizes are
explicit (no autotune: it needs a GPU driver and breaks the interpreter).
The env var must be set before this module is imported for the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from remax_megatron.kernels.logprobs_torch import weight_grad_buffer

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Interpreter blocks are tiny (numpy per block); GPU blocks suit tensor cores.
_BLOCKS = dict(n=16, v=16, d=16) if _INTERPRET else dict(n=64, v=128, d=64)
_CHUNK_ELEMS = 1 << 26  # [N, chunk] fp32 dz buffer budget: 256 MiB on GPU


@triton.jit
def _logit_tile(
    X,
    W,
    rows,
    cols,
    row_ok,
    col_ok,
    D,
    stride_x,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)  # [rows, cols]
    # 64-bit offsets: V_local * D passes 2^31 for large vocabularies at TP=1 (e.g. 256k x 16k).
    x_rows = rows.to(tl.int64)[:, None] * stride_x
    w_rows = cols.to(tl.int64)[:, None] * stride_w
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < D
        xt = tl.load(X + x_rows + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [rows, d]
        wt = tl.load(W + w_rows + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [cols, d]
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        if IEEE:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    return acc


@triton.jit
def _fwd_stats_kernel(
    X,
    W,
    LAB,
    OUT,
    N,
    V,
    D,
    stride_x,
    stride_w,
    scale,
    tiles_per_split,
    WITH_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_split = tl.num_programs(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    lab = tl.load(LAB + rows, mask=row_ok, other=-1)  # [rows] local ids, -1 = elsewhere
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, tiles_per_split):
        cols = (pid_s * tiles_per_split + k) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = (
            _logit_tile(
                X, W, rows, cols, row_ok, col_ok, D, stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_D, UPCAST, IEEE
            )
            * scale
        )
        z = tl.where(col_ok[None, :], z, float("-inf"))
        t += tl.sum(tl.where(lab[:, None] == cols[None, :], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked tile guard
        alpha = tl.exp(m - m_ref)  # 0 while m = -inf
        e = tl.exp(z - m_ref[:, None])  # [rows, cols], 0 on masked cols
        if WITH_ENT:
            shift = tl.where(s > 0, m - m_ref, 0.0)
            zr = tl.where(col_ok[None, :], z - m_ref[:, None], 0.0)
            a = alpha * (a + shift * s) + tl.sum(e * zr, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new
    base = pid_s * N + rows
    tl.store(OUT + base, m, mask=row_ok)
    tl.store(OUT + n_split * N + base, s, mask=row_ok)
    tl.store(OUT + 2 * n_split * N + base, a, mask=row_ok)
    tl.store(OUT + 3 * n_split * N + base, t, mask=row_ok)


@triton.jit
def _bwd_dlogits_kernel(
    X,
    W,
    LAB,
    M,
    LOGS,
    MEAN,
    G,
    H,
    DZ,
    N,
    C,
    D,
    c0,
    stride_x,
    stride_w,
    stride_dz,
    scale,
    WITH_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cc = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    col_ok = cc < C
    cols = c0 + cc  # column inside this rank's shard
    z = (
        _logit_tile(X, W, rows, cols, row_ok, col_ok, D, stride_x, stride_w, BLOCK_N, BLOCK_V, BLOCK_D, UPCAST, IEEE)
        * scale
    )
    m = tl.load(M + rows, mask=row_ok, other=0.0)
    log_s = tl.load(LOGS + rows, mask=row_ok, other=0.0)
    g = tl.load(G + rows, mask=row_ok, other=0.0)
    lab = tl.load(LAB + rows, mask=row_ok, other=-1)
    zr = z - m[:, None]  # l - m
    p = tl.exp(zr - log_s[:, None])  # [rows, cols]
    coef = g[:, None] + tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if WITH_ENT:
        h = tl.load(H + rows, mask=row_ok, other=0.0)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        coef += h[:, None] * (zr - mean[:, None])
    dz = -p * coef + tl.where(lab[:, None] == cols[None, :], g[:, None], 0.0)
    dz = dz * scale
    tl.store(DZ + rows[:, None] * stride_dz + cc[None, :], dz, mask=row_ok[:, None] & col_ok[None, :])


class TritonBackend:
    """Launches the kernels above; see ``logprobs_torch`` for the protocol."""

    def __init__(self, chunk_elems: int = _CHUNK_ELEMS):
        self.chunk_elems = chunk_elems

    def with_chunk(self, chunk_elems: int) -> TritonBackend:
        return TritonBackend(chunk_elems)

    @staticmethod
    def _flags(x):
        upcast = _INTERPRET and x.dtype != torch.float32
        return upcast, x.dtype == torch.float32

    def forward_stats(self, x, w, local_labels, scale, with_entropy):
        x, w = _prep(x), _prep(w)
        n, d = x.shape
        v = w.shape[0]
        bn, bv, bd = _BLOCKS["n"], _BLOCKS["v"], _BLOCKS["d"]
        row_blocks = triton.cdiv(n, bn)
        tiles = triton.cdiv(v, bv)
        want = 1
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            want = max(1, min(tiles, triton.cdiv(2 * sms, max(row_blocks, 1))))
        per_split = max(1, triton.cdiv(tiles, want))
        splits = max(1, triton.cdiv(tiles, per_split))
        out = torch.empty(4, splits, n, dtype=torch.float32, device=x.device)  # m, s, a, t
        if n == 0 or v == 0:
            out[0].fill_(float("-inf"))
            out[1:].zero_()
            return out[0], out[1], out[2], out[3]
        labels = local_labels.to(torch.int32).contiguous()
        upcast, ieee = self._flags(x)
        _fwd_stats_kernel[(row_blocks, splits)](
            x,
            w,
            labels,
            out,
            n,
            v,
            d,
            x.stride(0),
            w.stride(0),
            float(scale),
            per_split,
            WITH_ENT=bool(with_entropy),
            BLOCK_N=bn,
            BLOCK_V=bv,
            BLOCK_D=bd,
            UPCAST=upcast,
            IEEE=ieee,
        )
        return out[0], out[1], out[2], out[3]

    def backward_grads(self, x, w, local_labels, scale, m, log_s, mean_rel, g, h, need_x, need_w, grad_rows):
        w_dtype = w.dtype
        x, w = _prep(x), _prep(w)
        n, d = x.shape
        v = w.shape[0]
        grad_x = torch.zeros(n, d, dtype=torch.float32, device=x.device) if need_x else None
        padded, grad_w = weight_grad_buffer(grad_rows, v, d, w_dtype, w.device) if need_w else (None, None)
        if n == 0 or v == 0:
            return grad_x, padded
        bn, bv, bd = _BLOCKS["n"], _BLOCKS["v"], _BLOCKS["d"]
        chunk = max(bv, (self.chunk_elems // n) // bv * bv)
        chunk = min(chunk, triton.cdiv(v, bv) * bv)
        dz = torch.empty(n, chunk, dtype=torch.float32, device=x.device)  # [N, chunk]
        labels = local_labels.to(torch.int32).contiguous()
        m, log_s = m.float().contiguous(), log_s.float().contiguous()
        mean_rel = mean_rel.float().contiguous()
        g = g.float().contiguous()
        hh = h.float().contiguous() if h is not None else g
        upcast, ieee = self._flags(x)
        # bf16/fp16 GEMMs on GPU (fp32 accumulate in cuBLAS); fp32 elsewhere.
        mm = x.dtype if (x.is_cuda and x.dtype != torch.float32) else torch.float32
        xm = x.to(mm)
        for c0 in range(0, v, chunk):
            c = min(chunk, v - c0)
            _bwd_dlogits_kernel[(triton.cdiv(n, bn), triton.cdiv(c, bv))](
                x,
                w,
                labels,
                m,
                log_s,
                mean_rel,
                g,
                hh,
                dz,
                n,
                c,
                d,
                c0,
                x.stride(0),
                w.stride(0),
                dz.stride(0),
                float(scale),
                WITH_ENT=h is not None,
                BLOCK_N=bn,
                BLOCK_V=bv,
                BLOCK_D=bd,
                UPCAST=upcast,
                IEEE=ieee,
            )
            dzc = dz[:, :c].to(mm)  # [N, c]
            wc = w[c0 : c0 + c].to(mm)  # [c, D]
            if need_x:
                grad_x.add_(torch.matmul(dzc, wc).float())
            if need_w:
                grad_w[c0 : c0 + c].copy_(torch.matmul(dzc.T, xm))
        return grad_x, padded


def _prep(t):
    """Contiguous rows; fp64 (tests only) runs in fp32, Triton dots have no fp64 path."""
    return (t.float() if t.dtype == torch.float64 else t).contiguous()
