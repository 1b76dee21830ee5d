"""Engine-vs-actor log-prob mismatch: the silent killer of RL runs, watched every step.

    stats = logprob_mismatch(actor_logprobs, batch["engine_logprobs"], batch["response_mask"],
                             threshold=cfg.rollout.logprob_warn_threshold, group=None)
    metrics["logprob/engine_vs_actor_max_diff"] = stats["max"]

Both log-probs must follow the same convention (rollout/engine.py): the
sampled rows' engine log-probs against `token_logprobs(..., temperature=
rollout.temperature)`. A gap means the engine is not sampling from the policy
being trained: a stale or wrongly mapped weight sync, a dtype mismatch, or a
numerics bug (a bf16 engine against an fp32 actor typically shows ~1e-2).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import all_reduce_cpu

logger = logging.getLogger(__name__)


class LogprobMismatchWarning(UserWarning):
    """Engine and actor log-probs differ more than rollout.logprob_warn_threshold."""


def logprob_mismatch(
    actor_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float | None = None,
    group=None,
    constrained: bool = False,
) -> dict[str, float]:
    """max and mean of |actor - engine| over the masked tokens, and how far the engine is below the actor.

    actor_logprobs, engine_logprobs: [B, S] (any float dtype; compared in fp32)
    mask: [B, S] bool/0-1, the response tokens (pack_sequences' response_mask)
    threshold: warn (LogprobMismatchWarning + log) when max > threshold; None: never
    group: reduce over this process group (max of maxes, token-weighted mean); None: local
    constrained: the engine decoded under a constraint (guided decoding): its log-probs are of the
        allowed tokens renormalised, log p(t) - log(allowed mass) >= log p(t), so they sit ABOVE the
        actor's by design; only an engine below the actor ("below", max(actor - engine)) is then a
        mismatch, and the warning watches that.
    Returns {"max": float, "mean": float, "below": float, "tokens": int} (0.0 with no masked tokens).
    """
    if actor_logprobs.shape != engine_logprobs.shape or actor_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprob_mismatch shapes differ: actor {tuple(actor_logprobs.shape)}, engine "
            f"{tuple(engine_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    signed = (actor_logprobs.float() - engine_logprobs.float().to(actor_logprobs.device))[m.to(actor_logprobs.device)]
    diff = signed.abs()
    stats = torch.tensor(
        [diff.max().item() if diff.numel() else 0.0, max(signed.max().item(), 0.0) if signed.numel() else 0.0],
        dtype=torch.float64,
    )
    sums = torch.tensor([diff.double().sum().item(), float(diff.numel())], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        stats = all_reduce_cpu(stats, op=dist.ReduceOp.MAX, group=group)
        sums = all_reduce_cpu(sums, group=group)
    tokens = int(sums[1].item())
    out = {
        "max": float(stats[0].item()),
        "mean": float(sums[0].item() / tokens) if tokens else 0.0,
        "below": float(stats[1].item()),
        "tokens": tokens,
    }
    watched = out["below"] if constrained else out["max"]
    if threshold is not None and watched > threshold:
        what = (
            "the engine's log-probs are below the actor's (guided decoding only raises them)"
            if constrained
            else "engine vs actor log-probs differ"
        )
        message = (
            f"{what} by up to {watched:.3g} (mean |diff| {out['mean']:.3g}) > "
            f"rollout.logprob_warn_threshold={threshold}: check the weight sync and engine dtype"
        )
        logger.warning(message)
        warnings.warn(message, LogprobMismatchWarning, stacklevel=2)
    return out
