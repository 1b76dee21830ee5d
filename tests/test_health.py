"""The run's health checks (remax_megatron/health.py) on step records:

- no learning signal (every sample tied with its greedy reward) for trainer.no_signal_steps steps in
  a row: one warning naming the likely cause (top_k=1, a temperature near 0, samples identical to
  greedy, a reward that never fires / never varies, else a coarse reward or a converged policy);
  a step with a signal restarts the count; said once per run
- entropy at the uniform bound after being below it: warned once, and no checkpoint while it lasts
- a grad norm over 10x its recent range: warned once; a non-finite one is the optimizer's (skipped)

Through the real trainer (top_k=1 warns, a NaN update is skipped and the checkpoint keeps the last
finite weights, lr=1e3 collapses and is not saved): tests/train/test_step_invariants.py.
"""

import math

from remax_megatron.config import load_config
from remax_megatron.health import TrainingHealth

VOCAB = 101


def _cfg(*overrides):
    return load_config(None, ["reward.functions=[exact_match]", "trainer.no_signal_steps=3", *overrides])


def _record(step, ties=1.0, same=0.0, low=0.0, high=1.0, entropy=0.5, grad_norm=1.0):
    return {
        "step": step,
        "reward/tie_frac": ties,
        "rollout/same_as_greedy_frac": same,
        "reward/min": low,
        "reward/max": high,
        "entropy/mean": entropy,
        "grad_norm": grad_norm,
        "reward/sampled_mean": 0.5,
    }


def _run(health, records):
    return [line for r in records for line in health.observe(r)]


def test_no_signal_warns_once_after_the_steps_naming_top_k():
    health = TrainingHealth(_cfg("rollout.top_k=1"), VOCAB)
    lines = _run(health, [_record(1), _record(2, ties=0.5), _record(3), _record(4)])
    assert lines == []  # step 2 had a signal: the run of ties restarted at step 3
    lines = _run(health, [_record(5), _record(6), _record(7)])
    assert len(lines) == 1 and lines[0].startswith(
        "warning: no learning signal for 3 steps (steps 3-5): every sampled response got its prompt's greedy reward"
    ), lines
    assert "likely cause: rollout.top_k=1 makes sampling greedy decoding" in lines[0]
    assert "\n" not in lines[0]


def test_no_signal_names_the_cause():
    def cause(*overrides, **fields):
        health = TrainingHealth(_cfg(*overrides), VOCAB)
        (line,) = _run(health, [_record(s, **fields) for s in (1, 2, 3)])
        return line.split("likely cause: ")[1]

    assert cause("rollout.temperature=0.01").startswith("rollout.temperature=0.01 is so low")
    assert cause(same=1.0).startswith("every sampled response equals its greedy one")
    assert cause(low=0.0, high=0.0).startswith("every reward was 0: the reward never fires")
    assert cause(low=1.0, high=1.0).startswith("every reward was 1: the reward never varies")
    assert cause().startswith("the samples differ but score like their greedy ones")
    assert _run(TrainingHealth(_cfg("trainer.no_signal_steps=0"), VOCAB), [_record(s) for s in range(1, 30)]) == []


def test_collapse_to_uniform_warns_and_refuses_saves_while_it_lasts():
    bound = math.log(VOCAB)
    health = TrainingHealth(_cfg(), VOCAB)
    untrained = TrainingHealth(_cfg(), VOCAB)
    assert _run(untrained, [_record(1, ties=0.0, entropy=bound)]) == []  # it started uniform: nothing collapsed
    assert untrained.save_refusal() is None
    assert _run(health, [_record(1, ties=0.0, entropy=0.2)]) == [] and health.save_refusal() is None
    lines = _run(health, [_record(2, ties=0.0, entropy=bound), _record(3, ties=0.0, entropy=bound)])
    assert len(lines) == 1 and lines[0].startswith(
        "warning: the policy collapsed to uniform at step 2: entropy "
        f"{bound:.3f}, the uniform bound is ln(vocab) = {bound:.3f}"
    )
    assert health.save_refusal().startswith("the policy has been collapsed to uniform since step 2")
    _run(health, [_record(4, ties=0.0, entropy=1.0)])
    assert health.save_refusal() is None  # recovered: saving again


def test_an_exploding_grad_norm_warns_once():
    health = TrainingHealth(_cfg(), VOCAB)
    lines = _run(
        health,
        [
            _record(s, ties=0.0, grad_norm=g)
            for s, g in enumerate([1.0, 2.0, float("nan"), 1.5, 19.0, 25.0, 300.0], start=1)
        ],
    )
    assert len(lines) == 1 and lines[0].startswith(
        "warning: grad norm 300 at step 7 is over 10x the largest of the 5 updates before (25)"
    ), lines
