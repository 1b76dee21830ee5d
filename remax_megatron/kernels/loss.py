"""The ReMax policy loss on per-token log-probs, with KL and aggregation.

Per token (``A`` = advantages broadcast to ``[B, T]`` when given per sequence):

    pg   = -A * logp                                  (no old log-probs)
    pg   = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)),
           ratio = exp(logp - old_logp)               (PPO-style, with old)
    pg   = pg * w                                     (rollout correction weights, when given:
                                                       remax_megatron.algo.rollout_correction)
    kl   = k1 | k2 | k3 (logp, ref_logp)              (remax_megatron.algo.kl)
    loss = pg + kl_coef * kl - entropy_coef * entropy

then aggregated by ``remax_megatron.algo.aggregation.aggregate`` with GLOBAL
token or sequence counts, so summing the per-micro-batch losses gives the loss
of the whole step. With a single update per rollout ``old_logp == logp`` and
the clipped form has the same gradient as ``-A * logp``.

Plain torch on every device, not fused into the Triton epilogue: the loss is
``O(B * T)`` elementwise work next to the ``O(tokens * vocab * hidden)``
log-prob GEMMs, so fusing it would not pay for the loss of readability.
"""

from __future__ import annotations

import torch

from remax_megatron.algo.aggregation import AGG_MODES, aggregate
from remax_megatron.algo.kl import KL_ESTIMATORS, kl_estimate


def remax_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: float | int | torch.Tensor | None = None,
    global_num_seqs: float | int | torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ReMax loss of one micro-batch and detached stats.

    logprobs [B, T] (differentiable), advantages [B] or [B, T], mask [B, T],
    old_logprobs / ref_logprobs / entropy / is_weights [B, T] optional (is_weights: the
    rollout correction's per-token weights of the policy-gradient term, no gradient through
    them). ``clip_eps`` is the lower clip and also the upper one unless ``clip_eps_high`` is given.
    Returns ``(loss, stats)``. Every stat (``pg_loss``, ``kl``, ``entropy``,
    ``clip_frac``, ``ratio``, ``adv``) is aggregated like the loss, so it sums
    over micro-batches (and DP ranks) to the step's value; stats are 0-dim
    detached tensors (no host sync here).
    """
    _check(
        logprobs,
        advantages,
        mask,
        old_logprobs,
        ref_logprobs,
        entropy,
        loss_agg_mode,
        kl_estimator,
        clip_eps,
        clip_eps_high,
        is_weights,
    )
    b, t = logprobs.shape
    lp = logprobs.float() if logprobs.dtype != torch.float64 else logprobs
    adv = advantages.to(lp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand(b, t)  # [B, T]
    agg = dict(mode=loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs)
    stats = {}
    pg, ratio, clipped = _policy_gradient_term(lp, adv, old_logprobs, clip_eps, clip_eps_high)
    if is_weights is not None:
        pg = pg * is_weights.detach().to(lp.dtype)
    per_token = pg
    stats["pg_loss"] = aggregate(pg.detach(), mask, **agg)
    if ref_logprobs is not None:
        kl = kl_estimate(lp, ref_logprobs, kl_estimator)  # [B, T]
        if kl_coef != 0:
            per_token = per_token + kl_coef * kl
        stats["kl"] = aggregate(kl.detach(), mask, **agg)
    if entropy is not None:
        ent = entropy.to(lp.dtype)
        if entropy_coef != 0:
            per_token = per_token - entropy_coef * ent
        stats["entropy"] = aggregate(ent.detach(), mask, **agg)
    loss = aggregate(per_token, mask, **agg)
    stats["clip_frac"] = aggregate(clipped, mask, **agg)
    stats["ratio"] = aggregate(ratio.detach(), mask, **agg)
    stats["adv"] = aggregate(adv.detach(), mask, **agg)
    stats["loss"] = loss.detach()
    return loss, stats


def _policy_gradient_term(
    lp: torch.Tensor, adv: torch.Tensor, old_logprobs: torch.Tensor | None, clip_eps: float, clip_eps_high: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss, ratio and clipped flag, all [B, T]: -A * logprob on-policy (no
    old log-probs), else the clipped-ratio (PPO-style) term with clip range [1 - clip_eps, 1 + high]."""
    if old_logprobs is None:
        pg = -adv * lp  # [B, T]
        ratio = torch.ones_like(lp)
        clipped = torch.zeros_like(lp)
    else:
        ratio = torch.exp(lp - old_logprobs.to(lp.dtype))  # [B, T]
        hi = clip_eps if clip_eps_high is None else clip_eps_high
        unclipped = -adv * ratio
        clipped_pg = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + hi)
        pg = torch.maximum(unclipped, clipped_pg)
        clipped = (clipped_pg > unclipped).to(lp.dtype)
    return pg, ratio, clipped


def logprob_gradient(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_num_tokens=None,
    global_num_seqs=None,
) -> torch.Tensor:
    """d loss / d logprobs ``[B, T]`` of :func:`remax_loss` on-policy without KL or entropy bonus
    (no old or reference log-probs): that loss is linear in the log-probs, so its gradient is the
    same wherever they lie and is known before they are computed (``fused_logprobs``'s
    ``grad_hint``). Taken by autograd through ``remax_loss`` itself, so every aggregation mode agrees."""
    x = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        loss, _ = remax_loss(
            x,
            advantages,
            mask,
            loss_agg_mode=loss_agg_mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
        )
    return torch.autograd.grad(loss, x)[0]


def _check(logprobs, advantages, mask, old, ref, entropy, mode, kl_estimator, eps, eps_high, is_weights=None):
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs: shape {tuple(logprobs.shape)} must be [B, T]")
    b, t = logprobs.shape
    if mask.shape != (b, t):
        raise ValueError(f"mask: shape {tuple(mask.shape)} must be [{b}, {t}] like logprobs")
    if advantages.shape not in ((b,), (b, t)):
        raise ValueError(
            f"advantages: shape {tuple(advantages.shape)} must be [{b}] (per sequence) or [{b}, {t}] (per token)"
        )
    for name, x in (("old_logprobs", old), ("ref_logprobs", ref), ("entropy", entropy), ("is_weights", is_weights)):
        if x is not None and x.shape != (b, t):
            raise ValueError(f"{name}: shape {tuple(x.shape)} must be [{b}, {t}] like logprobs")
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown value {mode!r}; use one of {AGG_MODES}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: unknown value {kl_estimator!r}; use one of {KL_ESTIMATORS}")
    if not 0 < eps < 1:
        raise ValueError(f"clip_eps: {eps!r} must lie in (0, 1)")
    if eps_high is not None and not eps_high > 0:
        raise ValueError(f"clip_eps_high: {eps_high!r} must be > 0")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs: dtype {logprobs.dtype} must be floating point")
