"""rollout.logprob_warn_threshold=auto: the engine-vs-actor gap judged against the floor measured at the first step.

Fast lane: synthetic log-probs with a bf16-like and an fp32-like floor (the tiny default's measured sizes,
docs/benchmarks.md), an engine that keeps following the actor (quiet) and one that stops (warns at once)."""

import warnings

import pytest
import torch

from remax_megatron.config import load_config
from remax_megatron.rollout.monitor import LogprobMismatchWarning, MismatchFloor, logprob_mismatch, warn_rule

B, S = 24, 32  # 768 response tokens a step, the tiny default's order


def _step(seed: int, noise: float, stale: torch.Tensor | None = None):
    """(actor, engine, mask): the actor's log-probs, the engine's = actor + per-token noise of the dtype's size
    (heavy-tailed as bf16 rounding is: most tokens tiny, a few large) + a stale engine's offset."""
    g = torch.Generator().manual_seed(seed)
    actor = -torch.rand(B, S, generator=g) * 3
    spikes = (torch.rand(B, S, generator=g) < 0.05).float() * 10
    engine = actor + noise * torch.randn(B, S, generator=g) * (1 + spikes)
    if stale is not None:
        engine = engine + stale
    return actor, engine, torch.ones(B, S, dtype=torch.bool)


@pytest.mark.parametrize("noise", [3e-3, 3e-7], ids=["bf16-like", "fp32-like"])
def test_an_engine_that_follows_the_actor_is_quiet_one_that_stops_warns_naming_the_floor(noise):
    rule = MismatchFloor()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(20):  # following the actor: only the dtype's noise, fresh each step
            logprob_mismatch(*_step(step, noise), threshold=rule)
    assert rule.floor is not None and rule.floor["tokens"] == B * S
    # The engine stops following: the actor moved on (a skipped sync): a |shift| of up to 3e-2 per token (mean 1.5e-2,
    # ~4x the bf16-like floor's mean; in fp32 it alone is the gap). In bf16 a much smaller shift drowns in the floor.
    shift = 3e-2 * torch.rand(B, S, generator=torch.Generator().manual_seed(99)) * torch.sign(torch.randn(B, S))
    with pytest.warns(LogprobMismatchWarning, match=r"floor's mean .* rollout.logprob_warn_threshold=auto") as caught:
        stats = logprob_mismatch(*_step(100, noise, stale=shift), threshold=rule)
    assert f"{rule.floor['mean']:.3g}" in str(caught[0].message)
    assert stats["mean"] > rule.limit(stats["tokens"])


def test_a_fixed_number_keeps_the_max_rule_and_bad_settings_fail_early():
    assert isinstance(warn_rule("auto"), MismatchFloor) and warn_rule("0.05") == 0.05
    actor, engine, mask = _step(0, 3e-3)
    with pytest.warns(LogprobMismatchWarning, match="rollout.logprob_warn_threshold=0.01"):
        logprob_mismatch(actor, engine, mask, threshold=warn_rule(0.01))
    for bad in ("-1", "often", "0"):
        with pytest.raises(ValueError, match="rollout.logprob_warn_threshold=.* must be auto or a number > 0"):
            load_config(None, ["reward.functions=[exact_match]", f"rollout.logprob_warn_threshold={bad}"])
    assert load_config(None, ["reward.functions=[exact_match]"]).rollout.logprob_warn_threshold == "auto"


def test_a_first_step_beyond_nemo_rls_bound_warns():
    """An engine wrong from the start (no healthy floor): mean exp(|diff|) > 1.05 at the first step."""
    actor, engine, mask = _step(0, 3e-3)
    with pytest.warns(LogprobMismatchWarning, match="mean exp"):
        logprob_mismatch(actor, engine + 0.2, mask, threshold=MismatchFloor())
