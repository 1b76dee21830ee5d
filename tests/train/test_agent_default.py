"""The tiny agent default (configs/tiny_cpu_agent.yaml) end to end: ReMax teaches builtin:tiny-agent to call its
calculator. Greedy eval starts at <= 0.2 (the warm start never calls the tool greedily) and reaches >= 0.8 within
40 steps, with the README's launcher, vLLM's CPU build and actor TP=2 (other layouts: test_agent_layouts.py)."""

import json
import os

import pytest

from remax_megatron.builtin import models as bm
from tests.train.test_train_e2e import README_LAUNCHER, _train_logged, assert_fp32_rounding_only

CONFIG = "configs/tiny_cpu_agent.yaml"


@pytest.fixture(scope="module")
def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def assert_learns_the_tool(records):
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    assert len(evals) == 5 and evals[0] <= 0.2 and evals[-1] >= 0.8, evals
    train = [r for r in records if "loss" in r]
    calls = [r["agent/tool_calls_mean"] for r in train]
    assert len(train) == 40 and calls[0] <= 0.5 and min(calls[-5:]) >= 0.8, calls
    return evals, train


@pytest.mark.slow
def test_the_agent_default_learns_to_call_its_tool(env, tmp_path):
    """The README's command for the agent default; the last step's dump shows the greedy trajectory is the
    warm start's tool transcript, token for token (call, the calculator's answer, its copy)."""
    records, stdout, _ = _train_logged(
        env, CONFIG, str(tmp_path / "run"), "logging.rollouts_every=40", launcher=README_LAUNCHER
    )
    evals, train = assert_learns_the_tool(records)
    # measured: 0.0 -> 0.9 (step 10) -> 1.0 (20, 30, 40); tool calls per trajectory 0.23 -> ~1.0
    assert_fp32_rounding_only(r["logprob/engine_vs_actor_max_diff"] for r in train)
    assert all(r["agent/tool_errors"] <= 2 for r in train), [r["agent/tool_errors"] for r in train]
    info = bm.read_build_info(bm.ensure_builtin_model("tiny-agent"))["metrics"]
    assert info["greedy_calls"] == 0 and 0.2 <= info["p_tool"] <= 0.3 and info["tool_transcript_followed"] >= 0.95
    from transformers import AutoTokenizer

    from remax_megatron.builtin.agent import transcript

    tok = AutoTokenizer.from_pretrained(bm.ensure_builtin_model("tiny-agent"))
    with open(tmp_path / "run" / "rollouts" / "step_000040.jsonl") as f:
        rows = [json.loads(line) for line in f]
    greedy = [r for r in rows if r["sample"] == "greedy"]
    assert len(rows) == 8 * 5 and len(greedy) == 8
    for row in greedy:
        question = row["prompt"][-1]["content"]
        ids, labels = transcript(tok, question, use_tool=True)
        prompt_len = labels.index(next(x for x in labels if x != -100))
        assert row["response"] == tok.decode(ids[prompt_len:], skip_special_tokens=True), row
        assert row["completion_tokens"] == len(ids) - prompt_len and row["reward"] == 1.0, row
    assert '\'<tool_call>{"name": "calculator"' in stdout or '<tool_call>{"name": "calculator"' in stdout
