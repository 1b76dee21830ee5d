"""Chunked plain-torch backend of :func:`remax_megatron.kernels.fused_logprobs`.

The CPU path (and a fallback on any device). It walks ``[rows, vocab]`` tiles
whose size is bounded by ``chunk_elems`` elements; every tile is a GEMM plus a
few in-place elementwise ops in fp32, so the working set is a couple of tiles
instead of the ``[tokens, vocab]`` logits. The logits GEMM runs in fp32 (bf16/fp16
inputs upcast: torch has no bf16 x bf16 -> fp32 GEMM on CPU), so the softmax
statistics are those of exact fp32 logits. The two gradient GEMMs take bf16 inputs
as they are (the tile's gradient rounded to bf16; oneDNN accumulates in fp32, 2-3x
fp32's speed on AVX512-BF16), as cuBLAS does for the Triton backend on GPU; fp16 is
upcast (see ``gemm_dtype``).

Backend protocol (shared with the Triton backend):

- ``forward_stats(x, w, local_labels, scale, with_entropy) -> (m, s, a, t)``,
  each ``[K, N]`` fp32 partial online-softmax states over this rank's shard
  (see ``logprobs.py``); ``local_labels`` is ``-1`` where the target is not in
  the shard.
- ``backward_grads(x, w, local_labels, scale, m, log_s, mean_rel, g, h,
  need_x, need_w, grad_rows)`` (the merged state: ``p = exp(l - m - log_s)``,
  ``E_p[l] = m + mean_rel``) -> (grad_x fp32 [N, D] partial over this shard, grad_w [grad_rows, D]
  in w's dtype)``, where ``g``/``h`` are the upstream gradients of logprob and
  entropy (already zero on ignored rows; ``h`` may be None); ``grad_rows >= V_local`` (the rows of
  the caller's weight, vocab padding included: those grad rows are zero).
- optional ``forward_with_grads(x, w, local_labels, scale, with_entropy, g, total_vocab, merge,
  need_x, need_w, grad_rows) -> ((m, s, a, t) merged [N], grad_x, grad_w)`` (grad_x in the compute dtype,
  grad_w too or, from one row tile of bf16 inputs, in bf16; the caller scales, then casts): both at once for an
  incoming log-prob gradient ``g`` known in advance (``grad_hint``); ``merge(m, s, a, t)``
  merges one row tile's states over TP (a collective: every rank calls it equally often).
"""

from __future__ import annotations

import torch

from remax_megatron.sizes import round_up

# 16M elements = 64 MiB per fp32 tile; two or three tiles are live at a time. A micro-batch of 512
# labelled rows x a 32k vocab is one row tile: the weight-grad GEMM then runs once with K = 512 rather
# than twice with K = 256 (10% faster here; the whole fused pass 5%).
DEFAULT_CHUNK_ELEMS = 1 << 24
_MIN_COLS = 256
_ROW_ALIGN = 16  # elements: logits rows 64-byte aligned in fp32 (_logits)


def tile_shape(n: int, v: int, budget: int) -> tuple[int, int]:
    """(rows, cols) of a tile of at most ``budget`` elements: whole rows when they
    fit, cols a multiple of 256 when wider than that (GEMM-friendly)."""
    cols = max(1, min(v, budget // max(n, 1)))
    if _MIN_COLS <= cols < v:
        cols = cols // _MIN_COLS * _MIN_COLS
    rows = max(1, min(n, budget // cols))
    return rows, cols


class TorchBackend:
    """Tile loops in plain torch; ``chunk_elems`` bounds the tile size."""

    def __init__(self, chunk_elems: int = DEFAULT_CHUNK_ELEMS):
        self.chunk_elems = chunk_elems

    def with_chunk(self, chunk_elems: int) -> TorchBackend:
        return TorchBackend(chunk_elems)

    def forward_stats(self, x, w, local_labels, scale, with_entropy):
        n, v = x.shape[0], w.shape[0]
        ct = compute_dtype(x)
        m = torch.full((n,), float("-inf"), dtype=ct, device=x.device)
        s = torch.zeros(n, dtype=ct, device=x.device)
        a = torch.zeros_like(s)
        t = torch.zeros_like(s)
        if n == 0 or v == 0:
            return m[None], s[None], a[None], t[None]
        rows, cols = tile_shape(n, v, self.chunk_elems)
        x32 = x.to(ct)  # [N, D]; no copy for fp32
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            xr, lab = x32[r0:r1], local_labels[r0:r1]
            mr, sr, ar, tr = m[r0:r1], s[r0:r1], a[r0:r1], t[r0:r1]
            for c0 in range(0, v, cols):
                c1 = min(v, c0 + cols)
                z = _logits(xr, w[c0:c1].to(ct))  # [rows, cols]
                z.mul_(scale)
                _gather_target(z, lab, c0, c1, tr)
                m_new = torch.maximum(mr, z.amax(dim=1))  # [rows]
                alpha = torch.exp(mr - m_new)  # 0 on the first tile (mr = -inf)
                z.sub_(m_new[:, None])  # z - m_new <= 0
                if with_entropy:
                    shift = torch.where(sr > 0, mr - m_new, torch.zeros_like(mr))
                    ar.add_(shift * sr).mul_(alpha)
                    e = torch.exp(z)
                    # z * e in place (z is not needed after): no temporary tile, and a pairwise sum
                    # (einsum's batched dot was 3x slower here and accumulated 40x the error)
                    ar.add_(z.mul_(e).sum(dim=1))
                    sr.mul_(alpha).add_(e.sum(dim=1))
                else:
                    sr.mul_(alpha).add_(z.exp_().sum(dim=1))
                mr.copy_(m_new)
        return m[None], s[None], a[None], t[None]

    def backward_grads(self, x, w, local_labels, scale, m, log_s, mean_rel, g, h, need_x, need_w, grad_rows):
        n, d = x.shape
        v = w.shape[0]
        ct = compute_dtype(x)
        mm = gemm_dtype(x, w)
        grad_x = torch.zeros(n, d, dtype=ct, device=x.device) if need_x else None
        # every vocab chunk's first row tile writes its rows (with no rows, they stay zero)
        padded, grad_w = (
            weight_grad_buffer(grad_rows, v, d, w.dtype, w.device, written=n > 0) if need_w else (None, None)
        )
        if n == 0 or v == 0:
            return grad_x, padded
        rows, cols = tile_shape(n, v, self.chunk_elems)
        x32 = x.to(ct)
        xm = x32 if mm == ct else x.to(mm)  # one copy at most (fp16: the fp32 one serves both)
        gs = g.to(ct) * scale  # [N], scale folds 1/temperature into the chain rule
        hs = h.to(ct) * scale if h is not None else None
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            wc = w[c0:c1].to(ct)  # [cols, D]
            wm = wc if mm == ct else w[c0:c1].to(mm)
            gw = None
            if need_w:  # one row tile in w's dtype writes the grad directly; else an fp32 sum, copied in
                single = rows == n and w.dtype == mm
                gw = grad_w[c0:c1] if single else torch.empty(c1 - c0, d, dtype=ct, device=x.device)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                dz = self._dlogits(
                    x32[r0:r1],
                    wc,
                    local_labels[r0:r1],
                    c0,
                    c1,
                    scale,
                    m[r0:r1],
                    log_s[r0:r1],
                    mean_rel[r0:r1],
                    gs[r0:r1],
                    None if hs is None else hs[r0:r1],
                ).to(mm)  # [rows, cols]
                if need_x:
                    _gemm_into(grad_x[r0:r1], dz, wm, add=True)
                if need_w:
                    _gemm_into(gw, dz.T, xm[r0:r1], add=r0 > 0)
            if need_w and gw.data_ptr() != grad_w[c0:c1].data_ptr():
                grad_w[c0:c1].copy_(gw)
        return grad_x, padded

    def forward_with_grads(
        self, x, w, local_labels, scale, with_entropy, g, total_vocab, merge, need_x, need_w, grad_rows
    ):
        """Statistics and gradients in one pass over the logits, for the log-prob gradient ``g`` [N].

        Row tiles span this rank's whole vocab shard, so after ``merge`` a tile's softmax is final
        and its gradient ``g (onehot(y) - p)`` is taken from the tile in hand: the forward GEMM,
        then the two gradient GEMMs, and no recomputation. The tile height comes from the global
        vocab (the same on every TP rank, so every rank merges equally often).
        """
        n, d = x.shape
        v = w.shape[0]
        ct, mm = compute_dtype(x), gemm_dtype(x, w)
        m = torch.empty(n, dtype=ct, device=x.device)
        s, a, t = torch.empty_like(m), torch.zeros_like(m), torch.zeros_like(m)
        grad_x = torch.empty(n, d, dtype=ct, device=x.device) if need_x else None
        rows = max(1, min(n, self.chunk_elems // max(total_vocab, 1)))
        # the first row tile writes grad_w, the others add to it (with no rows, it stays zero); in the
        # GEMM's dtype when one row tile makes it, else summed in fp32
        grad_w_dtype = mm if rows >= n else ct
        padded, grad_w = (
            weight_grad_buffer(grad_rows, v, d, grad_w_dtype, x.device, written=n > 0) if need_w else (None, None)
        )
        x32, w32 = x.to(ct), w.to(ct)  # no copy for fp32 (bf16: one fp32 copy of the shard)
        xm, wm = (x32, w32) if mm == ct else (x.to(mm), w.to(mm))  # the gradient GEMMs' operands (bf16: no copy)
        gs = g.to(ct) * scale  # [N], 1/temperature folded into the chain rule
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            xr, lab, gr = x32[r0:r1], local_labels[r0:r1], gs[r0:r1]
            z = _logits(xr, w32).mul_(scale)  # [rows, V]
            tr = t[r0:r1]
            _gather_target(z, lab, 0, v, tr)
            if v:
                mr = z.amax(dim=1)  # [rows]
                z.sub_(mr[:, None])
                if with_entropy:
                    e = torch.exp(z)
                    ar = z.mul_(e).sum(dim=1)  # z is not needed after (see forward_stats)
                else:
                    e, ar = z.exp_(), a[r0:r1]
                sr = e.sum(dim=1)
            else:  # an empty shard (all vocab padding): no logits here
                mr = torch.full((r1 - r0,), float("-inf"), dtype=ct, device=x.device)
                sr, ar = torch.zeros_like(mr), torch.zeros_like(mr)
            m_local = mr
            mr, sr, ar, tr = merge(mr, sr, ar, tr)  # this tile's rows over the whole vocab
            m[r0:r1], s[r0:r1], a[r0:r1], t[r0:r1] = mr, sr, ar, tr
            if not v:
                if need_x:
                    grad_x[r0:r1].zero_()
                continue
            # e = exp(l - m_local), so p = e * exp(m_local - m) / s; dz = g (onehot(y) - p): [rows, V]
            dz = e.mul_((torch.exp(m_local - mr) / sr * -gr)[:, None])
            _add_at_target(dz, lab, 0, v, gr)
            dz = dz.to(mm)  # no copy for fp32
            if need_x:
                _gemm_into(grad_x[r0:r1], dz, wm, add=False)
            if need_w:
                _gemm_into(grad_w, dz.T, xm[r0:r1], add=r0 > 0)
        # grad_x in the compute dtype, grad_w in grad_w_dtype: the backward scales, then casts
        return (m, s, a, t), grad_x, padded

    @staticmethod
    def _dlogits(xr, wc, lab, c0, c1, scale, m, log_s, mean_rel, gs, hs):
        """Gradient w.r.t. the pre-temperature logits of one tile: [rows, cols]."""
        z = _logits(xr, wc)  # [rows, cols]
        z.mul_(scale).sub_(m[:, None]).sub_(log_s[:, None])  # log p
        if hs is None:
            dz = z.exp_().mul_(-gs[:, None])  # -g p
        else:
            q = z + (log_s - mean_rel)[:, None]  # l - E[l]
            p = z.exp_()
            dz = q.mul_(hs[:, None]).add_(gs[:, None]).mul_(p).neg_()  # -p (g + h (l - E l))
        _add_at_target(dz, lab, c0, c1, gs)  # d logprob / d l = onehot(y) - p
        return dz


def compute_dtype(x):
    """fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 (the tests' oracle)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def gemm_dtype(x, w):
    """The gradient GEMMs' operand dtype: bf16 when x and w both are (fp32 accumulation inside the GEMM);
    all else computes in compute_dtype. Not fp16: the hint path's gradient is not loss-scaled yet (megatron's
    fp16 scale arrives later as a factor), and fp16 flushes a g * p of 1e-8 to zero; on CPU torch's fp16
    GEMM is also ~20x slower than fp32. bf16 has fp32's exponent range."""
    return torch.bfloat16 if x.dtype == w.dtype == torch.bfloat16 else compute_dtype(x)


def _gemm_into(out, a, b, *, add: bool):
    """out = a @ b, or out += a @ b with ``add``; a bf16 product summed into an fp32 ``out`` goes
    through a temporary (torch's GEMMs write their inputs' dtype)."""
    if out.dtype == a.dtype:
        if add:
            out.addmm_(a, b)
        else:
            torch.matmul(a, b, out=out)
    elif add:
        out.add_(torch.matmul(a, b))
    else:
        out.copy_(torch.matmul(a, b))


def weight_grad_buffer(grad_rows, real_rows, d, dtype, device, *, written: bool = False):
    """(grad [grad_rows, D], its view [real_rows, D]) of a weight whose rows past real_rows are vocab
    padding: those are zero; the real rows too, unless the caller `written` overwrites them."""
    full = torch.empty(grad_rows, d, dtype=dtype, device=device)
    full[real_rows if written else 0 :].zero_()
    return full, full[:real_rows]


def _logits(x, w):
    """x [rows, D] @ w [cols, D].T -> logits [rows, cols], a view into a buffer whose rows are padded to
    64 bytes: BLAS writes rows of an odd width (a vocab of 32003) about 1.3x slower (the 60M benchmark's
    261 x 512 x 32003 tile: 83 ms against 107 ms)."""
    rows, cols = x.shape[0], w.shape[0]
    width = round_up(cols, _ROW_ALIGN)
    if width == cols:
        return torch.matmul(x, w.T)
    return torch.matmul(x, w.T, out=torch.empty(rows, width, dtype=x.dtype, device=x.device)[:, :cols])


def _add_at_target(dz, lab, c0, c1, values):
    """dz[i, lab[i] - c0] += values[i] for labels inside this tile's columns."""
    hit = (lab >= c0) & (lab < c1)
    if bool(hit.any()):
        idx = torch.nonzero(hit).squeeze(1)
        dz[idx, lab[idx] - c0] += values[idx]


def _gather_target(z, lab, c0, c1, out):
    """out[i] = z[i, lab[i] - c0] for labels inside this tile's columns."""
    hit = (lab >= c0) & (lab < c1)
    if bool(hit.any()):
        idx = torch.nonzero(hit).squeeze(1)
        out[idx] = z[idx, lab[idx] - c0]
