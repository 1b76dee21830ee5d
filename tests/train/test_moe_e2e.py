"""The embedded mixture-of-experts default end to end under torchrun (2 gloo processes, vLLM's CPU build):
configs/tiny_cpu_moe.yaml, a tiny upcycled Mixtral with its experts split over both ranks (EP=2), learns
the built-in arithmetic, the engine follows the actor every step, the MoE metrics are logged, and resuming
its step-20 checkpoint repeats steps 21-30 exactly."""

import os

import pytest

from tests.train.test_train_e2e import assert_fp32_rounding_only, assert_learns, _timeless, _train, _train_logged, env  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def moe_run(env, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("moe") / "run"
    records, stdout, _ = _train_logged(env, "configs/tiny_cpu_moe.yaml", str(out), "trainer.eval_every=30")
    return out, records, stdout


@pytest.mark.slow
def test_tiny_moe_default_learns_at_ep2_with_vllm(moe_run):
    out, records, stdout = moe_run
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 30]
    # Measured 0.0 -> 1.0 on an AMD EPYC (2 cores): the dense warm start's odds, upcycled.
    assert_learns([r["eval/reward_mean"] for r in evals])
    train = [r for r in records if "loss" in r]
    assert len(train) == 30
    # The engine samples from exactly the weights the actor trains (its experts gathered over EP and
    # re-processed after each vLLM reload): fp32 rounding only, every step (measured max 7.2e-6 on an
    # Intel Xeon, 1.0014e-5 on one step of 30 on CI's AMD EPYC).
    assert_fp32_rounding_only([r["logprob/engine_vs_actor_max_diff"] for r in train])
    # Load balancing: a loss near 1 (1.0 = balanced) and each layer's busiest expert over the mean.
    assert all(0.9 < r["moe/aux_loss"] < 2.0 and r["moe/expert_load"] >= 1.0 for r in train), [
        (r["moe/aux_loss"], r["moe/expert_load"]) for r in train
    ]
    assert all(r["grad_norm"] > 0 for r in train)


@pytest.mark.slow
def test_tiny_moe_default_resumes_exactly(env, moe_run, tmp_path):  # noqa: F811
    out, straight, _ = moe_run
    resumed = _train(
        env,
        "configs/tiny_cpu_moe.yaml",
        str(tmp_path / "resumed"),
        "trainer.eval_every=30",
        f"checkpoint.resume={os.path.join(out, 'checkpoints', 'step_000020')}",
    )
    assert [r["step"] for r in resumed] == list(range(21, 31))
    assert _timeless(resumed) == _timeless([r for r in straight if r["step"] > 20])


@pytest.mark.slow
def test_routing_replay_with_the_native_engine_at_ep2(env, tmp_path):  # noqa: F811
    """rollout.routing_replay on CPU: the native engine records the experts of every token it feeds, the
    step packs them with their rows and the EP=2 actor's training forward routes there; in fp32 the
    engine still follows the actor to rounding every step (the routes agree, so the replay is exact)."""
    records = _train(
        env,
        "configs/tiny_cpu_moe.yaml",
        str(tmp_path / "replay"),
        "rollout.engine=native",
        "rollout.routing_replay=true",
        "trainer.steps=3",
        "trainer.eval_every=0",
        "checkpoint.save_every=0",
    )
    train = [r for r in records if "loss" in r]
    assert len(train) == 3 and all(r["grad_norm"] > 0 for r in train)
    assert_fp32_rounding_only([r["logprob/engine_vs_actor_max_diff"] for r in train])
    assert all(r["moe/route_mismatch_frac"] == 0.0 for r in train), train  # the live router agrees in fp32
