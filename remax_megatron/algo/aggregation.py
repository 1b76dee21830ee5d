"""Reduce a per-token loss ``[B, T]`` to a scalar, with GLOBAL normalisers.

A step's batch is split into micro-batches (gradient accumulation) and DP
ranks. Normalising each micro-batch by its own token count makes the gradient
depend on the micro-batch size (a bug others shipped). Here the caller passes
the counts over the whole step (all micro-batches, all DP ranks), so summing
the per-micro-batch losses (and all-reducing the grads over DP) gives exactly
the loss of the whole batch:

- ``token-mean``:          sum_{b,t} mask * l / global_num_tokens
- ``seq-mean-token-sum``:  sum_b (sum_t mask * l) / global_num_seqs
- ``seq-mean-token-mean``: sum_b (sum_t mask * l / max(1, sum_t mask)) / global_num_seqs

A sequence with no response token contributes 0 (but still counts in
``global_num_seqs`` if the caller counted it). When a count is None the local
one is used (single micro-batch, single rank).
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_num_tokens: float | int | torch.Tensor | None = None,
    global_num_seqs: float | int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar aggregate of ``values [B, T]`` over ``mask [B, T]`` (see module doc)."""
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown value {mode!r}; use one of {AGG_MODES}")
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"mask: shape {tuple(mask.shape)} must be [B, T] and equal the per-token values {tuple(values.shape)}"
        )
    m = mask.to(values.dtype)  # [B, T]
    if mode == "token-mean":
        denom = (
            m.sum().clamp(min=1.0) if global_num_tokens is None else _positive("global_num_tokens", global_num_tokens)
        )
        return (values * m).sum() / denom
    denom = float(mask.shape[0]) if global_num_seqs is None else _positive("global_num_seqs", global_num_seqs)
    per_seq = (values * m).sum(dim=1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(dim=1).clamp(min=1.0)
    return per_seq.sum() / denom


def _positive(name, value):
    v = float(value) if not isinstance(value, torch.Tensor) else value
    if (v <= 0) if not isinstance(v, torch.Tensor) else bool((v <= 0).any()):
        raise ValueError(f"{name}: {value!r} must be > 0 (count over all micro-batches and DP ranks)")
    return v
