"""Importance-sampling correction of the rollout engine / trainer mismatch (algo.rollout_correction).

The engine samples from pi_engine (vLLM's kernels, its dtype, possibly an older policy version); the
loss is written for pi_actor_old, the actor's log-probs of the same tokens under the weights that
were meant to generate them. Per response token, in fp32 from log-prob differences:

    ratio_t = exp(actor_old_t - engine_t)

- ``token-tis``: each token's policy-gradient loss is weighted by min(ratio_t, cap), no gradient
  through the weight (truncated IS, Yao et al. 2025; verl token-level TIS).
- ``seq-mis``: a sequence's geometric-mean ratio exp(mean_t(actor_old_t - engine_t)) outside
  [1/cap, cap] masks the whole sequence out of the loss. The masked sequence still counts in the
  loss's GLOBAL token / sequence count (the denominator stays the batch's), as verl's seq_mis does:
  masking changes which tokens carry gradient, never the scale of the others.

The sequence ratio is a mean of log-ratios, never exp(sum) over a long sequence (which underflows:
NeMo-RL #2269). The weights multiply the policy-gradient term only (not the KL or entropy terms).
"""

from __future__ import annotations

import math
import typing

import torch

from remax_megatron.config import RolloutCorrection

CORRECTIONS = typing.get_args(RolloutCorrection)
# Local sums a rank contributes to the step's is/* metrics (keys ending in _max are maxima).
STAT_KEYS = ("ratio_sum", "ratio_count", "ratio_max", "corrected")


def correction_weights(
    actor_old: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss weights [B, T] (detached, 0 off the mask) and this batch's local statistics.

    actor_old, engine: [B, T] log-probs of the same tokens (any float dtype; compared in fp32);
    mask: [B, T] response tokens. Statistics (0-dim float64 tensors, sums over this batch):
    ratio_sum / ratio_count / ratio_max over the unit the mode decides on (tokens for token-tis,
    sequences with a response token for seq-mis), and `corrected`: tokens whose weight was capped
    (token-tis) or sequences masked (seq-mis).
    """
    if mode not in CORRECTIONS or mode == "none":
        raise ValueError(f"algo.rollout_correction={mode!r}: weights exist for token-tis and seq-mis only")
    if not cap >= 1.0 or not math.isfinite(cap):
        raise ValueError(f"algo.rollout_is_cap={cap!r} must be a finite number >= 1")
    if actor_old.shape != engine.shape or actor_old.shape != mask.shape:
        raise ValueError(
            f"rollout correction: shapes differ: actor {tuple(actor_old.shape)}, engine "
            f"{tuple(engine.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    log_ratio = torch.where(m, actor_old.detach().float() - engine.detach().float().to(actor_old.device), 0.0)  # [B, T]
    if mode == "token-tis":
        ratio = torch.exp(log_ratio)  # [B, T]
        weights = torch.where(m, ratio.clamp(max=cap), 0.0)
        unit_ratio, units = ratio[m], m
        corrected = (m & (ratio > cap)).sum()
    else:
        tokens = m.sum(dim=1)  # [B]
        has_response = tokens > 0
        seq_ratio = torch.exp(log_ratio.sum(dim=1) / tokens.clamp(min=1))  # [B] geometric mean
        keep = (seq_ratio >= 1.0 / cap) & (seq_ratio <= cap)
        weights = (keep[:, None] & m).float()
        unit_ratio, units = seq_ratio[has_response], has_response
        corrected = (has_response & ~keep).sum()
    stats = {
        "ratio_sum": unit_ratio.double().sum(),
        "ratio_count": units.sum().double(),
        "ratio_max": unit_ratio.double().max() if unit_ratio.numel() else torch.zeros((), dtype=torch.float64),
        "corrected": corrected.double(),
    }
    return weights.detach(), stats


def correction_metrics(totals: dict[str, float], mode: str) -> dict[str, float]:
    """The step's is/* metrics from STAT_KEYS summed (ratio_max: maximised) over micro-batches and DP."""
    count = max(totals["ratio_count"], 1.0)
    frac = "is/clipped_frac" if mode == "token-tis" else "is/masked_frac"
    return {
        "is/ratio_mean": totals["ratio_sum"] / count,
        "is/ratio_max": totals["ratio_max"],
        frac: totals["corrected"] / count,
    }
