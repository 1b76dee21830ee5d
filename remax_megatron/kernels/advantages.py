"""ReMax advantages in one pass: reward-to-go with a per-token KL penalty,
minus the greedy baseline, masked and optionally clipped.

Math, for sequence b and response position t (``mask[b, t]`` = 1 on response
tokens):

    kl[b, k]  = -kl_coef * (logprobs[b, k] - ref_logprobs[b, k]) * mask[b, k]
    A[b, t]   = (rewards[b] - baseline[b] + sum_{k >= t} kl[b, k]) * mask[b, t]
    A         = clamp(A, -clip, clip)            (when clip is given)

i.e. the sequence reward sits on the last valid token and every token gets the
sum of what follows it (reward-to-go, no discount), and the baseline is the
reward of the prompt's greedy response, already broadcast per sample. With
``kl_coef = 0`` or no reference this is ``A = r - r_greedy`` on every response
token. Fully masked rows are all zero.

``compute_advantages`` runs a Triton kernel on CUDA (one program per
sequence, reverse scan over ``T`` in tiles with a carry) and the torch
reference elsewhere; both have the same signature.
"""

from __future__ import annotations

import os

import torch


def compute_advantages(
    rewards: torch.Tensor,
    baseline: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    kl_coef: float = 0.0,
    clip: float | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Per-token advantages ``[B, T]`` fp32 (see the module docstring).

    rewards [B], baseline [B] (greedy-response rewards per sample), mask [B, T]
    (bool or 0/1), logprobs / ref_logprobs [B, T] (actor and reference, only
    used when ``kl_coef != 0``). ``impl``: ``"torch"``, ``"triton"`` or None =
    env ``REMAX_KERNEL_IMPL``, else Triton on CUDA. Not differentiable (the
    advantages are constants of the policy-gradient loss).
    """
    _check(rewards, baseline, mask, logprobs, ref_logprobs, kl_coef, clip)
    choice = impl if impl is not None else os.environ.get("REMAX_KERNEL_IMPL") or None
    runs_triton = mask.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if choice is None or (impl is None and choice == "triton" and not runs_triton):
        # The env preference applies where Triton can run: the trainer's advantages are CPU tensors.
        choice = "triton" if mask.is_cuda else "torch"
    if choice == "torch":
        return compute_advantages_reference(rewards, baseline, mask, logprobs, ref_logprobs, kl_coef=kl_coef, clip=clip)
    if choice == "triton":
        if not runs_triton:
            raise ValueError(f"impl: 'triton' needs CUDA tensors or TRITON_INTERPRET=1 (mask is on {mask.device})")
        from remax_megatron.kernels.advantages_triton import advantages_triton

        use_kl = kl_coef != 0 and ref_logprobs is not None
        return advantages_triton(
            rewards,
            baseline,
            mask,
            logprobs if use_kl else None,
            ref_logprobs if use_kl else None,
            float(kl_coef),
            clip,
        )
    raise ValueError(f"impl: unknown value {choice!r}; use 'torch', 'triton' or None")


@torch.no_grad()
def compute_advantages_reference(
    rewards: torch.Tensor,
    baseline: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    kl_coef: float = 0.0,
    clip: float | None = None,
) -> torch.Tensor:
    """Plain-torch contract of :func:`compute_advantages` (its arguments but ``impl``, which picks this)."""
    _check(rewards, baseline, mask, logprobs, ref_logprobs, kl_coef, clip)
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    m = mask.to(dtype)  # [B, T]
    adv = (rewards.to(dtype) - baseline.to(dtype))[:, None] * m  # [B, T]
    if kl_coef != 0 and ref_logprobs is not None:
        kl = -kl_coef * (logprobs.to(dtype) - ref_logprobs.to(dtype)) * m  # [B, T]
        to_go = kl.flip(1).cumsum(1).flip(1)  # sum_{k >= t}
        adv = adv + to_go * m
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def _check(rewards, baseline, mask, logprobs, ref_logprobs, kl_coef, clip):
    if mask.dim() != 2:
        raise ValueError(f"mask: shape {tuple(mask.shape)} must be [B, T]")
    b, t = mask.shape
    if rewards.shape != (b,):
        raise ValueError(f"rewards: shape {tuple(rewards.shape)} must be [{b}] (one per sequence)")
    if baseline.shape != (b,):
        raise ValueError(
            f"baseline: shape {tuple(baseline.shape)} must be [{b}] (the greedy reward broadcast per sample)"
        )
    for name, x in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        if x is not None and x.shape != (b, t):
            raise ValueError(f"{name}: shape {tuple(x.shape)} must be [{b}, {t}] like mask")
    if kl_coef != 0 and ref_logprobs is not None and logprobs is None:
        raise ValueError("logprobs: None, but kl_coef != 0 with ref_logprobs needs them")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip: {clip!r} must be > 0 or None")
    if not rewards.is_floating_point() or not baseline.is_floating_point():
        raise ValueError(f"rewards/baseline: dtypes {rewards.dtype}/{baseline.dtype} must be floating point")
