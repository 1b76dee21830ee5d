"""Per-token log-probs and entropy straight from hidden states and the
(vocab-parallel) output weight, without materialising ``[tokens, vocab]``.

Math. With logits ``l = hidden @ weight.T / temperature`` over the global vocab
``V`` (the concatenation of every TP rank's shard):

    logprob_i = l[i, y_i] - logsumexp_j l[i, j]
    entropy_i = logsumexp_j l[i, j] - sum_j p[i, j] * l[i, j],  p = softmax(l[i])

Each rank streams its shard in vocab tiles and keeps, per token, an online
log-sum-exp state relative to a running max ``m``:

    s = sum_j exp(l_j - m),   a = sum_j exp(l_j - m) * (l_j - m),   t = l[y]

Two states merge exactly (``M = max(m1, m2)``, ``s = s1 e^(m1-M) + s2 e^(m2-M)``,
``a = sum_k e^(mk-M) (ak + (mk - M) sk)``), so only these ``O(tokens)`` numbers
cross the TP group (one MAX and one SUM all-reduce). Then
``logprob = (t - M) - log s`` and ``entropy = log s - a / s`` (no
cancellation of large logits). Backward recomputes the logit tiles from
``M``, ``log s`` and ``a / s = E_p[l] - M`` saved per token (kept apart so that
``|M| ~ 1e3`` does not round them), with ``p = exp((l - M) - log s)``:

    d logprob_i / d l_ij = 1[j = y_i] - p_ij
    d entropy_i / d l_ij = -p_ij (l_ij - E_p[l_i])

Tensor parallelism (megatron ``VocabParallel`` layout): rank r of ``tp_group``
holds the contiguous global rows ``[start_r, start_r + V_r)`` of the output
weight, shards in rank order (``start_r = V_0 + ... + V_{r-1}``). Megatron pads
the vocab and splits it evenly; an uneven (smaller) last shard also works. The
shard sizes are all-gathered once per ``(group, V_local)`` and cached.
``hidden`` must be the same on every TP rank (replicated, as the input of
megatron's ``ColumnParallelLinear``); each rank's gradient w.r.t. ``hidden`` is
then only its shard's partial sum, so backward ALL-REDUCES ``grad_hidden`` over
``tp_group`` (what ``copy_to_tensor_model_parallel_region`` does), and every
rank returns the full gradient. Pass ``reduce_hidden_grad=False`` when the
caller already reduces it (e.g. hidden was gathered from a sequence-parallel
region whose backward reduce-scatters). ``grad_weight`` is this rank's shard.

Gradient in the forward (``grad_hint``). When the caller's loss is linear in the log-probs
(on-policy ReMax without KL: ``loss = sum_i c_i logprob_i``), the gradient ``c`` it will send
back is known before the output layer runs. Both backends then take the gradients in the
forward's own pass over the logits (whole-vocab row tiles, so a tile's softmax is complete once
its statistics are merged over TP): three GEMMs over the output weight instead of four, the
backward's recomputation of the logit tiles is gone (``logprobs_triton.py`` names the three).
The backward checks that the gradient that arrives is ``k * c`` for one scalar ``k`` (a loss
scale) and scales the saved gradients; anything else (an entropy gradient, a loss that was not
linear after all) recomputes as without the hint, so the hint can cost time, never correctness.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from remax_megatron.kernels.logprobs_torch import compute_dtype
from remax_megatron.parallel.layout import SumGrad

IGNORE_INDEX = -100
_IMPL_ENV = "REMAX_KERNEL_IMPL"
_LAYOUT_CACHE: dict = {}


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = False,
    impl: str | None = None,
    valid_vocab: int | None = None,
    reduce_hidden_grad: bool = True,
    chunk_elems: int | None = None,
    grad_hint: torch.Tensor | None = None,
):
    """Fused per-token log-probs (and entropy) of ``labels``.

    hidden [N, D], weight [V_local, D] (this rank's vocab shard), labels [N]
    global vocab ids (``-100`` = ignore: logprob 0, entropy 0, no gradient; ignored rows (prompt,
    padding) are left out before the output layer, at the cost of one host sync for their count).
    Returns ``(logprobs [N] fp32, entropy [N] fp32 or None)``.

    impl: ``"torch"`` (chunked, any device), ``"triton"`` or ``None`` = the env
    var ``REMAX_KERNEL_IMPL`` if set, else Triton on CUDA and torch otherwise.
    valid_vocab: global ids ``>= valid_vocab`` (megatron's vocab padding) are
    left out of the softmax, as the HF model / rollout engine does.
    chunk_elems: torch path tile budget in elements of ``[rows, vocab]``.
    grad_hint: ``[N]``, the gradient the caller's loss will send into the log-probs, up to one
    scalar factor (module docstring); the torch backend then computes the gradients in the
    forward (both backends: three GEMM passes instead of four). Ignored when no gradient is needed.
    """
    _check_tensors(hidden, weight, labels, temperature)
    start, total = vocab_layout(weight.shape[0], tp_group, weight.device)
    limit = total if valid_vocab is None else int(valid_vocab)
    if not 0 < limit <= total:
        raise ValueError(f"valid_vocab: {valid_vocab} must lie in [1, {total}] (the global vocab)")
    _check_labels(labels, limit)
    # Vocab padding rows get no logits and a zero grad; sliced inside the autograd function, so that the
    # grad of the full weight is allocated once (a slice outside costs a zeroed copy of it per call).
    real_rows = min(weight.shape[0], max(0, limit - start))
    backend = _backend(impl, hidden)
    if chunk_elems is not None:
        backend = backend.with_chunk(int(chunk_elems))
    scale = 1.0 / float(temperature)
    # Only the rows with a label reach the output layer: prompt and padding positions cost no
    # logits (every TP rank holds the same labels, so the same rows).
    rows = torch.nonzero(labels != IGNORE_INDEX).squeeze(1)  # [M]
    every_row = rows.numel() == labels.numel()
    if grad_hint is not None:
        if grad_hint.shape != labels.shape:
            raise ValueError(f"grad_hint: shape {tuple(grad_hint.shape)} must be {tuple(labels.shape)} (one per label)")
        grad_hint = (grad_hint if every_row else grad_hint.index_select(0, rows)).detach()
    logp, ent = _FusedLogprobsFn.apply(
        hidden if every_row else hidden.index_select(0, rows),
        weight,
        labels if every_row else labels.index_select(0, rows),
        scale,
        tp_group,
        bool(with_entropy),
        start,
        backend,
        bool(reduce_hidden_grad),
        grad_hint,
        total,
        real_rows,
    )
    if not every_row:  # back to [N]: 0 on the ignored rows
        logp = logp.new_zeros(labels.shape[0]).index_copy(0, rows, logp)
        ent = ent.new_zeros(labels.shape[0]).index_copy(0, rows, ent) if with_entropy else None
    return logp, (ent if with_entropy else None)


def fused_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = False,
    valid_vocab: int | None = None,
    **_ignored,
):
    """The contract: full logits -> log_softmax -> gather, in fp32 (or fp64 for
    fp64 inputs). Under TP the logits are all-gathered along the vocab (the
    backward keeps this rank's slice, the grad of hidden is all-reduced like
    :func:`fused_logprobs`). Memory ``O(N * V)``; tests and benchmarks only."""
    _check_tensors(hidden, weight, labels, temperature)
    start, total = vocab_layout(weight.shape[0], tp_group, weight.device)
    limit = total if valid_vocab is None else int(valid_vocab)
    if not 0 < limit <= total:
        raise ValueError(f"valid_vocab: {valid_vocab} must lie in [1, {total}] (the global vocab)")
    _check_labels(labels, limit)
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    x = hidden.to(dtype)
    if tp_group is not None:
        x = SumGrad.apply(x, tp_group)  # replicated input: its gradient summed over TP
    logits = x @ weight.to(dtype).T / temperature  # [N, V_local]
    if tp_group is not None:
        logits = _GatherVocab.apply(logits, tp_group)  # [N, V]
    logits = logits[:, :limit]
    valid = labels != IGNORE_INDEX
    logsm = torch.log_softmax(logits, dim=-1)  # [N, V]
    idx = torch.where(valid, labels, torch.zeros_like(labels)).long()
    logp = logsm.gather(1, idx[:, None]).squeeze(1) * valid
    ent = None
    if with_entropy:
        ent = -(logsm.exp() * logsm).sum(-1) * valid
    return logp, ent


class _FusedLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        scale,
        group,
        with_entropy,
        start,
        backend,
        reduce_hidden_grad,
        hint,
        total_vocab,
        real_rows,
    ):
        ctx.real_rows = real_rows  # weight[:real_rows]: this shard's rows that are not vocab padding
        full_weight, weight = weight, weight[:real_rows]
        n, v_local = hidden.shape[0], weight.shape[0]
        valid = labels != IGNORE_INDEX  # [N]
        local = labels.long() - start
        local = torch.where(
            valid & (local >= 0) & (local < v_local), local, torch.full_like(local, -1)
        )  # [N], -1 = not in this shard
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.hinted = hint is not None and (need_x or need_w) and hasattr(backend, "forward_with_grads")
        saved_x = saved_w = None
        if ctx.hinted:
            hint = hint.to(hidden.device, compute_dtype(hidden)) * valid  # [N]
            merge = (lambda *stats: _merge_across(*stats, group)) if group is not None else (lambda *stats: stats)
            (m, s, a, t), saved_x, saved_w = backend.forward_with_grads(
                hidden,
                weight,
                local,
                scale,
                with_entropy,
                hint,
                total_vocab,
                merge,
                need_x,
                need_w,
                grad_rows=full_weight.shape[0],
            )
        else:
            hint = None
            m, s, a, t = backend.forward_stats(hidden, weight, local, scale, with_entropy)  # [K, N]
            m, s, a, t = merge_stats(m, s, a, t)  # [N]
            if group is not None:
                m, s, a, t = _merge_across(m, s, a, t, group)
        # keep m and log s apart: m + log s rounded at |m| ~ 1e3 would cost ~1e-4
        log_s = torch.log(s)  # [N]
        mean_rel = a / s  # [N], E_p[l] - m
        logp = torch.clamp((t - m) - log_s, max=0.0) * valid
        ent = torch.clamp(log_s - mean_rel, min=0.0) * valid
        ctx.save_for_backward(hidden, full_weight, local, valid, m, log_s, mean_rel, hint, saved_x, saved_w)
        # An output the loss does not use (the entropy, a metric) gets None, not zeros: no entropy term
        # in the backward tiles.
        ctx.set_materialize_grads(False)
        ctx.scale, ctx.group, ctx.with_entropy = scale, group, with_entropy
        ctx.backend, ctx.reduce_hidden_grad = backend, reduce_hidden_grad
        assert logp.shape == (n,)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, local, valid, m, log_s, mean_rel, hint, saved_x, saved_w = ctx.saved_tensors
        vf = valid.to(m.dtype)
        g = grad_logp.to(m.dtype) * vf if grad_logp is not None else torch.zeros_like(m)  # [N]
        h = None
        if ctx.with_entropy and grad_ent is not None:
            h = grad_ent.to(m.dtype) * vf  # [N]
        k = scalar_multiple(g, hint) if ctx.hinted and h is None else None
        if k is not None:  # the gradients were taken in the forward for `hint`: g = k * hint
            grad_x = saved_x if saved_x is None or k == 1.0 else saved_x.mul_(k)
            grad_w = saved_w if saved_w is None or k == 1.0 else saved_w.mul_(k)
            grad_w = grad_w if grad_w is None else grad_w.to(weight.dtype)
        else:
            grad_x, grad_w = ctx.backend.backward_grads(
                hidden,
                weight[: ctx.real_rows],
                local,
                ctx.scale,
                m,
                log_s,
                mean_rel,
                g,
                h,
                ctx.needs_input_grad[0],
                ctx.needs_input_grad[1],
                grad_rows=weight.shape[0],
            )
        if grad_x is not None:
            if ctx.group is not None and ctx.reduce_hidden_grad:
                dist.all_reduce(grad_x, group=ctx.group)
            grad_x = grad_x.to(hidden.dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None


def scalar_multiple(g: torch.Tensor, hint: torch.Tensor, rtol: float = 1e-6) -> float | None:
    """``k`` with ``g == k * hint`` (within ``rtol`` of ``max |g|``), else None; [N] each. One host sync."""
    if hint.numel() == 0:
        return 0.0
    i = hint.abs().argmax()
    k = g[i] / hint[i]  # inf / nan when the hint is all zeros
    off = (g - k * hint).abs().max()
    k, off, top, biggest = torch.stack([k, off, hint[i].abs(), g.abs().max()]).tolist()
    if top == 0.0:
        return 0.0 if biggest == 0.0 else None
    return k if off <= rtol * biggest else None


def merge_stats(m, s, a, t):
    """Merge K partial online-softmax states ``[K, N]`` into one ``[N]`` (exact)."""
    big = m.max(dim=0).values  # [N]
    safe = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    has = s > 0  # [K, N], empty partials carry m = -inf
    diff = torch.where(has, m - safe, torch.zeros_like(m))
    w = torch.where(has, torch.exp(diff), torch.zeros_like(m))
    s_tot = (s * w).sum(0)
    a_tot = (w * (a + diff * s)).sum(0)
    return big, s_tot, a_tot, t.sum(0)


def _merge_across(m, s, a, t, group):
    """Merge per-rank states over the TP group: one MAX and one SUM all-reduce."""
    big = m.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    has = s > 0
    diff = torch.where(has, m - big, torch.zeros_like(m))
    w = torch.where(has, torch.exp(diff), torch.zeros_like(m))
    packed = torch.stack([s * w, w * (a + diff * s), t])  # [3, N]
    dist.all_reduce(packed, group=group)
    return big, packed[0], packed[1], packed[2]


def vocab_layout(v_local: int, group, device) -> tuple[int, int]:
    """(first global vocab id of this rank's shard, global vocab size).

    Shards are contiguous in rank order. Cached per ``(group, v_local)``: the
    layout of a group must not change during the process."""
    if group is None:
        return 0, v_local
    key = (group, v_local)
    if key not in _LAYOUT_CACHE:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([v_local], dtype=torch.long, device=dev), group=group)
        sizes = [int(x.item()) for x in sizes]
        _LAYOUT_CACHE[key] = (sum(sizes[:rank]), sum(sizes))
    return _LAYOUT_CACHE[key]


class _GatherVocab(torch.autograd.Function):
    """All-gather ``[N, V_r]`` shards along the vocab; backward keeps own slice."""

    @staticmethod
    def forward(ctx, x, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([x.shape[1]], device=x.device), group=group)
        sizes = [int(v) for v in sizes]
        width = max(sizes)
        pad = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        pad[:, : x.shape[1]] = x
        parts = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(parts, pad.contiguous(), group=group)
        ctx.lo, ctx.hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.lo : ctx.hi].contiguous(), None


def _backend(impl, hidden):
    choice = impl if impl is not None else os.environ.get(_IMPL_ENV) or None
    if choice is None:
        choice = "triton" if hidden.is_cuda and _triton_available() else "torch"
    if choice == "torch":
        from remax_megatron.kernels.logprobs_torch import TorchBackend

        return TorchBackend()
    if choice == "triton":
        if not (hidden.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError(f"impl: 'triton' needs CUDA tensors or TRITON_INTERPRET=1 (hidden is on {hidden.device})")
        from remax_megatron.kernels.logprobs_triton import TritonBackend

        return TritonBackend()
    raise ValueError(f"impl: unknown value {choice!r}; use 'torch', 'triton' or None")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_tensors(hidden, weight, labels, temperature):
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: {temperature!r} must be a number > 0")
    if hidden.dim() != 2:
        raise ValueError(
            f"hidden: shape {tuple(hidden.shape)} must be [N, D] (reshape megatron's [S, B, D] to [S*B, D])"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight: shape {tuple(weight.shape)} must be [V_local, "
            f"{hidden.shape[1]}] to match hidden {tuple(hidden.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels: shape {tuple(labels.shape)} must be [{hidden.shape[0]}] to match hidden {tuple(hidden.shape)}"
        )
    if not hidden.is_floating_point():
        raise ValueError(f"hidden: dtype {hidden.dtype} must be floating point")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} must equal hidden's {hidden.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels: dtype {labels.dtype} must be int64 or int32")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"weight/labels: devices {weight.device}/{labels.device} must equal hidden's {hidden.device}")


def _check_labels(labels, vocab):
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = int(labels[bad][0])
        raise ValueError(
            f"labels: id {first} is outside the global vocab [0, {vocab}) (use {IGNORE_INDEX} to ignore a position)"
        )
