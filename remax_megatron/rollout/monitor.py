"""Engine-vs-actor log-prob mismatch: the silent killer of RL runs, watched every step.

    rule = warn_rule(cfg.rollout.logprob_warn_threshold)     # "auto": a MismatchFloor; a number: fixed
    stats = logprob_mismatch(actor_logprobs, batch["engine_logprobs"], batch["response_mask"],
                             threshold=rule, group=None)
    metrics["logprob/engine_vs_actor_max_diff"] = stats["max"]

Both log-probs must follow the same convention (rollout/engine.py): the
sampled rows' engine log-probs against `token_logprobs(..., temperature=
rollout.temperature)`. A gap means the engine is not sampling from the policy
being trained: a stale or wrongly mapped weight sync, a dtype mismatch, or a
numerics bug. Two correct forwards already differ: in fp32 by ~1e-6 (the
attention kernels' floor, docs/benchmarks.md), in bf16 by ~5e-3 on average and
up to ~0.3 on single tokens (the tiny default), so a fixed threshold either
warns at every step of a healthy bf16 run or misses a stale fp32 engine.
`MismatchFloor` ("auto") takes the first judged steps (>= 100 tokens), the
engine freshly synced from the actor (the same weights through both forwards),
as the floor of the run's dtype and warns when a later step's mean |diff|
exceeds `multiple` x the floor's mean plus `z` standard errors (never below
`min_mean`).
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import all_reduce_cpu

logger = logging.getLogger(__name__)


CONSTRAINED_THRESHOLD = 0.05  # "below" limit under guided decoding when the setting is auto


class LogprobMismatchWarning(UserWarning):
    """Engine and actor log-probs differ more than rollout.logprob_warn_threshold allows."""


class MismatchFloor:
    """rollout.logprob_warn_threshold=auto: the mismatch judged against the run's own floor.

        floor = MismatchFloor()
        floor.judge(stats)   # None, or the warning's text; the first steps measure the floor

    The floor is the gap of the first judged steps (the engine synced from the actor just before: the same
    weights through both forwards), pooled until it holds `min_tokens` tokens (one step of a real run; the
    tiny default's ~12 tokens a step take ~8): its mean |diff| m0 and the standard deviation s0 of the
    per-token |diff| over n0 tokens. A later step of n tokens exceeds it when its mean |diff| >
    max(multiple * m0 + z * s0 * sqrt(1/n + 1/n0), min_mean): the mean of many tokens is steady where the
    max is not (in bf16 the max is one token's rounding), and the error term covers both means' sampling
    noise (heavy-tailed in bf16: hence a multiple of 3 and z = 4). min_mean: the fp32 floor is ~1e-7 and
    training moves it; 1e-5 is the repository's fp32 median rule. While the floor is pooled a step is
    judged by NeMo-RL's bound alone (mean exp(|diff|) > 1.05): no healthy engine starts there.
    """

    def __init__(
        self,
        multiple: float = 3.0,
        z: float = 4.0,
        min_mean: float = 1e-5,
        min_tokens: int = 100,
        first_bound: float = 1.05,
    ):
        self.multiple, self.z, self.min_mean, self.first_bound = multiple, z, min_mean, first_bound
        self.min_tokens = min_tokens
        self._pool = {"sum": 0.0, "sq": 0.0, "tokens": 0, "max": 0.0, "steps": 0}
        self.floor: dict[str, float] | None = None

    def limit(self, tokens: int) -> float:
        """The largest mean |diff| a step of `tokens` tokens may show."""
        f = self.floor
        noise = self.z * f["sd"] * math.sqrt(1 / max(tokens, 1) + 1 / f["tokens"])
        return max(self.multiple * f["mean"] + noise, self.min_mean)

    def judge(self, stats: dict[str, float]) -> str | None:
        if not stats["tokens"]:
            return None
        if self.floor is None:
            self._add(stats)
            if stats["exp_mean"] > self.first_bound:
                return (
                    f"engine vs actor log-probs differ by mean exp(|diff|) {stats['exp_mean']:.4g} > "
                    f"{self.first_bound} (NeMo-RL's bound; mean |diff| {stats['mean']:.3g}, max {stats['max']:.3g}) "
                    "while the floor is measured: check the weight sync and engine dtype"
                )
            return None
        limit = self.limit(stats["tokens"])
        if stats["mean"] <= limit:
            return None
        f = self.floor
        return (
            f"engine vs actor log-probs differ by mean |diff| {stats['mean']:.3g} (max {stats['max']:.3g}, "
            f"{stats['tokens']} tokens) > {limit:.3g} = {self.multiple} x the floor's mean {f['mean']:.3g} + "
            f"{self.z} standard errors (floor: the first {f['steps']} step(s) after a sync, {f['tokens']} tokens, "
            f"sd {f['sd']:.3g}, max {f['max']:.3g}; rollout.logprob_warn_threshold=auto): the engine is not "
            "sampling from the actor's weights (a stale or wrongly mapped sync?)"
        )

    def _add(self, stats: dict[str, float]) -> None:
        """Pool a step into the floor; fix the floor once it holds min_tokens tokens."""
        p, n = self._pool, stats["tokens"]
        p["sum"] += stats["mean"] * n
        p["sq"] += (stats["sd"] ** 2 + stats["mean"] ** 2) * n
        p["tokens"] += n
        p["max"] = max(p["max"], stats["max"])
        p["steps"] += 1
        if p["tokens"] >= self.min_tokens:
            mean = p["sum"] / p["tokens"]
            sd = math.sqrt(max(p["sq"] / p["tokens"] - mean**2, 0.0))
            self.floor = {"mean": mean, "sd": sd, "max": p["max"], "tokens": p["tokens"], "steps": p["steps"]}


def warn_rule(setting) -> MismatchFloor | float:
    """rollout.logprob_warn_threshold as the monitor's rule: "auto" -> a fresh MismatchFloor, else the fixed
    max |diff| threshold it names."""
    if str(setting).strip().lower() == "auto":
        return MismatchFloor()
    try:
        value = float(setting)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise ValueError(
            f"rollout.logprob_warn_threshold={setting!r} must be auto (judged against the measured floor) or a "
            "number > 0 (a fixed max |diff|)"
        )
    return value


def logprob_mismatch(
    actor_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float | MismatchFloor | None = None,
    group=None,
    constrained: bool = False,
) -> dict[str, float]:
    """max and mean of |actor - engine| over the masked tokens, and how far the engine is below the actor.

    actor_logprobs, engine_logprobs: [B, S] (any float dtype; compared in fp32)
    mask: [B, S] bool/0-1, the response tokens (pack_sequences' response_mask)
    threshold: a number: warn (LogprobMismatchWarning + log) when max > threshold; a MismatchFloor: warn
        when it judges the step above its floor; None: never
    group: reduce over this process group (max of maxes, token-weighted means); None: local
    constrained: the engine decoded under a constraint (guided decoding): its log-probs are of the
        allowed tokens renormalised, log p(t) - log(allowed mass) >= log p(t), so they sit ABOVE the
        actor's by design; only an engine below the actor ("below", max(actor - engine)) is then a
        mismatch, and the warning watches that (with a MismatchFloor: against CONSTRAINED_THRESHOLD).
    Returns {"max", "mean", "below", "tokens", "sd" (std of the per-token |diff|), "exp_mean" (mean
    exp(|diff|), NeMo-RL's statistic)} (0.0 with no masked tokens; exp_mean 1.0).
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
    d = diff.double()
    sums = torch.tensor([d.sum().item(), float(diff.numel()), d.pow(2).sum().item(), d.exp().sum().item()])
    sums = sums.double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        stats = all_reduce_cpu(stats, op=dist.ReduceOp.MAX, group=group)
        sums = all_reduce_cpu(sums, group=group)
    tokens = int(sums[1].item())
    mean = float(sums[0].item() / tokens) if tokens else 0.0
    out = {
        "max": float(stats[0].item()),
        "mean": mean,
        "below": float(stats[1].item()),
        "tokens": tokens,
        "sd": math.sqrt(max(float(sums[2].item()) / tokens - mean**2, 0.0)) if tokens else 0.0,
        "exp_mean": float(sums[3].item() / tokens) if tokens else 1.0,
    }
    if isinstance(threshold, MismatchFloor) and constrained:
        threshold = CONSTRAINED_THRESHOLD  # |diff| is large by design there: the fixed rule on "below"
    if isinstance(threshold, MismatchFloor):
        message = threshold.judge(out)
    else:
        message = None
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
    if message:
        logger.warning(message)
        warnings.warn(message, LogprobMismatchWarning, stacklevel=2)
    return out
