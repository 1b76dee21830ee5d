"""Triton backend of :func:`remax_megatron.kernels.fused_logprobs` (CUDA).

Three kernels; the first two compute logit tiles ``x[rows] @ w[cols].T`` with an fp32
accumulator (bf16/fp16 tiles feed ``tl.dot`` directly on GPU; under
``TRITON_INTERPRET=1`` they are cast to fp32 first, as the interpreter's bf16
dot is wrong):

- ``_fwd_stats_kernel``: grid ``(row blocks, vocab splits)``. Each program walks
  its split's vocab tiles and keeps the online state ``(m, s, a, t)`` of
  ``logprobs.py`` per row; the ``[splits, N]`` partial states are merged
  exactly in torch (the same merge as across TP ranks). Splitting the vocab
  keeps the GPU busy when there are few row blocks. With ``STORE_Z`` it also
  writes the (temperature-scaled) logit tile it computed: the ``grad_hint`` path.
- ``_bwd_dlogits_kernel``: for one vocab chunk, recomputes the logit tiles and
  writes the gradient w.r.t. the logits ``dz [N, chunk]`` (``-p (g + h (l -
  E l)) + g 1[j = y]`` times ``1/T``); the two gradient GEMMs
  ``grad_x += dz @ w_chunk`` and ``grad_w_chunk = dz.T @ x`` then run in
  cuBLAS. Only one ``[N, chunk]`` buffer is live, never ``[N, V]``.
- ``_hint_dlogits_kernel`` (no GEMM): turns stored logits into ``dz`` once their
  row's softmax statistics are final (``grad_hint``, below).

GEMM passes over ``[N, V_local, D]`` (one pass = ``2 N V D`` FLOPs, whatever the tiling):

- without a hint: forward 1 (logits, ``_fwd_stats_kernel``); backward 3 (the logits again in
  ``_bwd_dlogits_kernel``, ``dz @ W``, ``dz.T @ x``): 4.
- with ``grad_hint`` (``forward_with_grads``): row tiles of ``R`` rows span the whole vocab
  shard (``R * V_global <= hint_elems``). Per tile: (1) ``_fwd_stats_kernel`` with
  ``STORE_Z``: the logits GEMM, its statistics and the logits kept in an ``[R, V_local]`` fp32
  buffer; the statistics are merged over the vocab splits and over TP (then the tile's softmax
  is final); ``_hint_dlogits_kernel`` rewrites the buffer as ``dz`` (elementwise); (2)
  ``grad_x[tile] = dz @ W`` and (3) ``grad_w += dz.T @ x[tile]`` in cuBLAS. Three passes, no
  recomputation; the backward only scales the saved gradients (``logprobs.py``).

Block shapes. Under the interpreter: fixed 16 x 16 x 16 blocks (numpy per block; the CPU
tests stay fast). On a GPU the two GEMM kernels are ``triton.autotune``d over
``AUTOTUNE_CONFIGS`` (Hopper-sized tiles up to 128 x 256 x 64, 4-8 warps, 3-4 stages), keyed on
``AUTOTUNE_KEY``: power-of-two buckets of the row and vocab counts (``shape_bucket``) and the
hidden size, so a new token count tunes again only when it crosses a power of two. The
choice is cached on disk (``cache_results``, in ``TRITON_CACHE_DIR``, default
``~/.triton/cache``) where the installed Triton supports it, so a later run does not pay
the tuning in its first step.
Same backend protocol as ``logprobs_torch.TorchBackend``.
The env var must be set before this module is imported for the interpreter.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

from remax_megatron.kernels.logprobs_torch import _gemm_into, weight_grad_buffer

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Interpreter blocks are tiny (numpy per block): the CPU tests' shapes are tens of rows.
_INTERP_BLOCKS = dict(BLOCK_N=16, BLOCK_V=16, BLOCK_D=16)
# The elementwise hint kernel (no dot, so no tuning): rows x cols per program.
_EW_BLOCKS = (16, 16) if _INTERPRET else (32, 256)
_CHUNK_ELEMS = 1 << 26  # [N, chunk] fp32 dz buffer budget: 256 MiB on GPU
# The hint path's [R, V_local] fp32 logits tile: 1 GiB, R = 1766 rows at a 151936 vocab. Tall tiles keep the
# weight gradient's accumulation cheap: with several row tiles each adds its dz.T @ x (a bf16 [V, D] product,
# 1.25 GB at 151936 x 4096) into the fp32 gradient (2.5 GB read and written): ~7.5 GB of traffic a tile, ten
# tiles ~75 GB (~16 ms at 4.8 TB/s) where the 256 MiB budget's 38 tiles would move ~285 GB (~60 ms, more than
# half the issue-3 shape's 88 ms GEMM floor). Not measured on a GPU yet.
_HINT_ELEMS = 1 << 28


def _config(n, v, d, warps, stages):
    return triton.Config(dict(BLOCK_N=n, BLOCK_V=v, BLOCK_D=d), num_warps=warps, num_stages=stages)


# (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages). The first is the former fixed GPU block; the
# Hopper (sm90) tiles are 128 x 128 x 64 and 128 x 256 x 64 with 8 warps, 3-4 stages. A config that
# does not fit a device's shared memory or registers is skipped by the autotuner.
AUTOTUNE_CONFIGS = [
    _config(64, 128, 64, 4, 3),
    _config(64, 256, 64, 8, 3),
    _config(128, 64, 64, 4, 4),
    _config(128, 128, 64, 4, 4),
    _config(128, 128, 64, 8, 3),
    _config(128, 128, 64, 8, 4),
    _config(128, 256, 64, 8, 3),
    _config(128, 256, 64, 8, 4),
]
# Kernel arguments the tuned choice depends on: buckets of the shape, not the shape itself (the
# autotuner adds the tensors' dtypes).
AUTOTUNE_KEY = ["N_BUCKET", "V_BUCKET", "D"]


def shape_bucket(n: int) -> int:
    """The power of two at or above n (1 for n <= 1): the autotune key of a row or vocab count."""
    return 1 << max(0, int(n) - 1).bit_length()


def _autotuned(kernel):
    """The kernel under ``triton.autotune`` on a GPU; itself under the interpreter (fixed blocks)."""
    if _INTERPRET:
        return kernel
    extra = {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        extra["cache_results"] = True  # the choice persists in TRITON_CACHE_DIR across runs
    return triton.autotune(configs=AUTOTUNE_CONFIGS, key=AUTOTUNE_KEY, **extra)(kernel)


def _blocks(**kw):
    """Launch kwargs: the interpreter's fixed blocks; nothing on GPU (the autotuner picks them)."""
    return dict(kw, **_INTERP_BLOCKS) if _INTERPRET else kw


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
    Z,
    N,
    V,
    D,
    N_BUCKET,  # noqa: ARG001 (autotune key only)
    V_BUCKET,  # noqa: ARG001 (autotune key only)
    stride_x,
    stride_w,
    stride_z,
    scale,
    WITH_ENT: tl.constexpr,
    STORE_Z: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_split = tl.num_programs(1)
    # the split count is fixed by the caller (the partial-state buffer); a split past the last tile
    # walks nothing and leaves the empty state (m = -inf, s = 0), which the merge ignores
    tiles_per_split = tl.cdiv(tl.cdiv(V, BLOCK_V), n_split)
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
        if STORE_Z:  # [rows, cols] scaled logits for _hint_dlogits_kernel
            z_ptr = Z + rows.to(tl.int64)[:, None] * stride_z + cols[None, :]
            tl.store(z_ptr, z, mask=row_ok[:, None] & col_ok[None, :])
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
    N_BUCKET,  # noqa: ARG001 (autotune key only)
    V_BUCKET,  # noqa: ARG001 (autotune key only)
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
    tl.store(DZ + rows.to(tl.int64)[:, None] * stride_dz + cc[None, :], dz, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _hint_dlogits_kernel(
    Z, DZ, LAB, M, LOGS, GS, N, V, stride_z, stride_dz, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr
):
    """dz = g / T (1[j = y] - p) from the stored scaled logits z (p = exp(z - m - log s)): no GEMM.
    GS holds g / T; DZ may alias Z (each element is read before it is written, by one program)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < V)[None, :]
    z = tl.load(Z + rows.to(tl.int64)[:, None] * stride_z + cols[None, :], mask=ok, other=0.0)
    m = tl.load(M + rows, mask=row_ok, other=0.0)
    log_s = tl.load(LOGS + rows, mask=row_ok, other=0.0)
    gs = tl.load(GS + rows, mask=row_ok, other=0.0)
    lab = tl.load(LAB + rows, mask=row_ok, other=-1)
    p = tl.exp(z - m[:, None] - log_s[:, None])  # [rows, cols]
    dz = gs[:, None] * (tl.where(lab[:, None] == cols[None, :], 1.0, 0.0) - p)
    tl.store(DZ + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=ok)


_fwd_stats = _autotuned(_fwd_stats_kernel)
_bwd_dlogits = _autotuned(_bwd_dlogits_kernel)


def _stat_splits(x, n: int, v: int) -> int:
    """Vocab splits of the statistics kernel: about two programs per SM when rows are few (sized for
    64-row, 128-column blocks; the tuned blocks may differ, the merge is exact either way)."""
    if not x.is_cuda:
        return 1
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(triton.cdiv(v, 128), triton.cdiv(2 * sms, max(triton.cdiv(n, 64), 1))))


class TritonBackend:
    """Launches the kernels above; see ``logprobs_torch`` for the protocol."""

    def __init__(self, chunk_elems: int = _CHUNK_ELEMS, hint_elems: int = _HINT_ELEMS):
        self.chunk_elems, self.hint_elems = chunk_elems, hint_elems

    def with_chunk(self, chunk_elems: int) -> TritonBackend:
        """One budget for both paths (fused_logprobs' chunk_elems)."""
        return TritonBackend(chunk_elems, chunk_elems)

    @staticmethod
    def _flags(x):
        upcast = _INTERPRET and x.dtype != torch.float32
        return upcast, x.dtype == torch.float32

    def _stats(self, x, w, labels, scale, with_entropy, z=None):
        """Partial states ``[4, splits, n]`` (m, s, a, t) of rows x; with ``z`` [n, V] fp32 also the
        scaled logits. x, w prepared (``_prep``), labels int32."""
        n, d = x.shape
        v = w.shape[0]
        splits = _stat_splits(x, n, v)
        out = torch.empty(4, splits, n, dtype=torch.float32, device=x.device)  # m, s, a, t
        if n == 0 or v == 0:
            out[0].fill_(float("-inf"))
            out[1:].zero_()
            return out
        upcast, ieee = self._flags(x)
        _fwd_stats[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)](
            x,
            w,
            labels,
            out,
            out if z is None else z,
            n,
            v,
            d,
            shape_bucket(n),
            shape_bucket(v),
            x.stride(0),
            w.stride(0),
            0 if z is None else z.stride(0),
            float(scale),
            **_blocks(WITH_ENT=bool(with_entropy), STORE_Z=z is not None, UPCAST=upcast, IEEE=ieee),
        )
        return out

    def forward_stats(self, x, w, local_labels, scale, with_entropy):
        x, w = _prep(x), _prep(w)
        out = self._stats(x, w, local_labels.to(torch.int32).contiguous(), scale, with_entropy)
        return out[0], out[1], out[2], out[3]

    def forward_with_grads(
        self, x, w, local_labels, scale, with_entropy, g, total_vocab, merge, need_x, need_w, grad_rows
    ):
        """Statistics and the gradients for the log-prob gradient ``g`` [N] in three GEMM passes
        (module docstring): per row tile spanning the whole vocab shard, the logits GEMM stores its
        tile, the merged statistics turn it into ``dz``, then ``dz @ W`` and ``dz.T @ x``. The tile
        height comes from the global vocab, so every TP rank calls ``merge`` equally often."""
        from remax_megatron.kernels.logprobs import merge_stats

        x, w = _prep(x), _prep(w)
        n, d = x.shape
        v = w.shape[0]
        rows = max(1, min(n, self.hint_elems // max(total_vocab, 1)))
        # bf16/fp16 gradient GEMMs on GPU (fp32 accumulation in cuBLAS); fp32 elsewhere.
        mm = x.dtype if (x.is_cuda and x.dtype != torch.float32) else torch.float32
        # one row tile writes grad_w in the GEMM's dtype; several sum in fp32
        grad_w_dtype = mm if rows >= n else torch.float32
        m = torch.empty(n, dtype=torch.float32, device=x.device)
        s, a, t = torch.empty_like(m), torch.empty_like(m), torch.empty_like(m)
        grad_x = torch.empty(n, d, dtype=torch.float32, device=x.device) if need_x else None
        padded, grad_w = (
            weight_grad_buffer(grad_rows, v, d, grad_w_dtype, x.device, written=n > 0 and v > 0)
            if need_w
            else (None, None)
        )
        labels = local_labels.to(torch.int32).contiguous()
        gs = (g.float() * scale).contiguous()  # [N], 1/temperature folded into the chain rule
        xm, wm = x.to(mm), w.to(mm)  # the gradient GEMMs' operands (no copy when already mm)
        z = torch.empty(rows, v, dtype=torch.float32, device=x.device) if v else None  # [R, V_local]
        dz = z if z is None or mm == torch.float32 else torch.empty(rows, v, dtype=mm, device=x.device)
        bn, bv = _EW_BLOCKS
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            r = r1 - r0
            zr = None if z is None else z[:r]
            part = self._stats(x[r0:r1], w, labels[r0:r1], scale, with_entropy, z=zr)  # GEMM pass 1
            mr, sr, ar, tr = merge(*merge_stats(part[0], part[1], part[2], part[3]))  # [r], over all the vocab
            m[r0:r1], s[r0:r1], a[r0:r1], t[r0:r1] = mr, sr, ar, tr
            if not v:  # an empty shard (all vocab padding): no logits, no gradient here
                if need_x:
                    grad_x[r0:r1].zero_()
                continue
            dzr = dz[:r]
            _hint_dlogits_kernel[(triton.cdiv(r, bn), triton.cdiv(v, bv))](
                zr,
                dzr,
                labels[r0:r1],
                mr.contiguous(),
                torch.log(sr).contiguous(),
                gs[r0:r1],
                r,
                v,
                zr.stride(0),
                dzr.stride(0),
                BLOCK_N=bn,
                BLOCK_V=bv,
            )
            if need_x:  # GEMM pass 2
                _gemm_into(grad_x[r0:r1], dzr, wm, add=False)
            if need_w:  # GEMM pass 3
                _gemm_into(grad_w, dzr.T, xm[r0:r1], add=r0 > 0)
        # grad_x fp32, grad_w in grad_w_dtype: the backward scales, then casts to the weight's dtype
        return (m, s, a, t), grad_x, padded

    def backward_grads(self, x, w, local_labels, scale, m, log_s, mean_rel, g, h, need_x, need_w, grad_rows):
        w_dtype = w.dtype
        x, w = _prep(x), _prep(w)
        n, d = x.shape
        v = w.shape[0]
        grad_x = torch.zeros(n, d, dtype=torch.float32, device=x.device) if need_x else None
        padded, grad_w = weight_grad_buffer(grad_rows, v, d, w_dtype, w.device) if need_w else (None, None)
        if n == 0 or v == 0:
            return grad_x, padded
        # chunk columns: a multiple of the largest tuned BLOCK_V, so every chunk but the last is whole tiles
        align = _INTERP_BLOCKS["BLOCK_V"] if _INTERPRET else max(c.kwargs["BLOCK_V"] for c in AUTOTUNE_CONFIGS)
        chunk = max(align, (self.chunk_elems // n) // align * align)
        chunk = min(chunk, triton.cdiv(v, align) * align)
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
            _bwd_dlogits[lambda meta, c=c: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(c, meta["BLOCK_V"]))](
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
                shape_bucket(n),
                shape_bucket(c),
                c0,
                x.stride(0),
                w.stride(0),
                dz.stride(0),
                float(scale),
                **_blocks(WITH_ENT=h is not None, UPCAST=upcast, IEEE=ieee),
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
