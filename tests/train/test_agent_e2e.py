"""Multi-turn ReMax end to end (issue 41) on the tiny default with a 3-turn counter environment
(tests/rollout/agent_envs.py): actor tp2 with vLLM's CPU build and the native engine (engine-vs-actor gap over
generated tokens: fp32 rounding only, every step), separate placement one step ahead with LoRA, DP2 with an
environment that raises and hangs; the rollout dump holds the trajectories with their own prompt's greedy baseline."""

import json

import pytest

from tests.train.test_train_e2e import _train, assert_fp32_rounding_only, env  # noqa: F401  (env: fixture)

ENVS = "tests.rollout.agent_envs"
AGENT = (
    f"rollout.env={ENVS}:CounterEnv",
    "rollout.max_turns=3",
    "rollout.max_total_tokens=48",
    "trainer.steps=3",
    "trainer.eval_every=3",
    "trainer.eval_prompts=4",
    "logging.rollouts_every=1",
)
NATIVE = ("rollout.engine=native",)


def _steps(records):
    return [r for r in records if "loss" in r]


def _assert_multi_turn(steps):
    for r in steps:
        assert r["agent/turns_mean"] > 1 and r["agent/observation_tokens_mean"] > 0, r
        finishes = sum(r[f"agent/finish_{f}_frac"] for f in ("done", "max_turns", "max_total", "env_error"))
        assert abs(finishes - 1.0) < 1e-9 and "time/env_s" in r and r["time/tools_s"] == 0.0  # no tools


@pytest.mark.slow
@pytest.mark.parametrize("engine", [(), NATIVE], ids=["vllm", "native"])
def test_a_three_turn_environment_trains_at_tp2(env, tmp_path, engine):  # noqa: F811
    out = tmp_path / "run"
    records = _train(env, "configs/tiny_cpu.yaml", str(out), *AGENT, *engine)
    steps = _steps(records)
    assert len(steps) == 3
    _assert_multi_turn(steps)
    assert_fp32_rounding_only([r["logprob/engine_vs_actor_max_diff"] for r in steps])  # generated tokens only
    assert records[-1]["eval/agent/turns_mean"] > 1
    rows = [json.loads(line) for line in open(out / "rollouts" / "step_000002.jsonl")]
    assert len(rows) == 8 * 3  # prompts_per_step x (n + greedy)
    greedy = {r["prompt_index"]: r["reward"] for r in rows if r["sample"] == "greedy"}
    for r in rows:
        assert r["turns"] > 1 and r["observation_tokens"] > 0 and r["baseline"] == greedy[r["prompt_index"]]
        assert r["advantage"] == r["reward"] - r["baseline"]
        roles = [m["role"] for m in r["messages"]]
        assert roles[:3] == ["assistant", "user", "assistant"] and r["generated_tokens"] > 0


@pytest.mark.slow
def test_one_step_ahead_with_lora_on_the_rollout_ranks(env, tmp_path):  # noqa: F811
    records = _train(
        env,
        "configs/tiny_cpu.yaml",
        str(tmp_path / "run"),
        *AGENT,
        *NATIVE,
        "rollout.placement=separate",
        "rollout.ranks=1",
        "rollout.max_staleness=1",
        "algo.rollout_correction=token-tis",
        "actor.lora_rank=4",
        nproc=3,
    )
    steps = _steps(records)
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 1]
    _assert_multi_turn(steps)


@pytest.mark.slow
def test_environment_failures_cost_only_their_trajectories_at_dp2(env, tmp_path):  # noqa: F811
    """FlakyEnv raises on odd answers and hangs on 8 (5 s, past the 2 s limit): the run trains on."""
    records = _train(
        env,
        "configs/tiny_cpu.yaml",
        str(tmp_path / "run"),
        *AGENT,
        *NATIVE,
        f"rollout.env={ENVS}:FlakyEnv",
        "rollout.env_timeout_s=2",
        "actor.tp=1",
    )
    steps = _steps(records)
    assert len(steps) == 3
    assert sum(r["agent/env_errors"] for r in steps) > 0
    assert all(r["agent/finish_env_error_frac"] < 1 for r in steps)


@pytest.mark.slow
def test_reward_functions_read_the_environment_across_tensor_parallel_ranks(env, tmp_path):  # noqa: F811
    """An environment without reward(): the reward function gets each trajectory's environment, gathered
    from the rank that ran it to both ranks of the tp2 group (NoRewardEnv runs 2 turns: reward 2)."""
    records = _train(
        env,
        "configs/tiny_cpu.yaml",
        str(tmp_path / "run"),
        *AGENT,
        *NATIVE,
        f"rollout.env={ENVS}:NoRewardEnv",
        f"reward.functions=[{ENVS}:turns_reward]",
        "trainer.eval_every=0",
    )
    steps = _steps(records)
    assert [r["reward/sampled_mean"] for r in steps] == [2.0] * 3 and all(r["agent/turns_mean"] == 2 for r in steps)
