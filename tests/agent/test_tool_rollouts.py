"""rollout.tools through the multi-turn loop (rollout/agent.py) with a scripted engine: a turn's tool call runs,
its result is the next observation (a `tool` message in the chat template's rendering), the turn without a
call ends the trajectory, and the tool statistics reach the trajectory."""

import json
from types import SimpleNamespace

from transformers import AutoTokenizer

from remax_megatron.config import load_config
from remax_megatron.rollout import Completion, PromptRollout, RolloutEngine
from remax_megatron.rollout.agent import make_dispatch, trajectory_stats

GROUPS = SimpleNamespace(dp_size=1, dp_rank=0, mp_size=1, mp_rank=0)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


class ScriptedEngine(RolloutEngine):
    """Turn 1: every row calls the calculator (the greedy row with malformed JSON); later turns: "42"."""

    name = "scripted"

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def _completion(self, text):
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Completion(ids, [-0.5] * len(ids), "stop")

    def _generate(self, prompts, n, sampling, seeds):
        return [
            PromptRollout([self._completion(CALL) for _ in range(n)], self._completion("<tool_call>{oops</tool_call>"))
            for _ in prompts
        ]

    def _generate_rows(self, contexts, greedy, sampling, seeds, limits):
        return [self._completion("42") for _ in contexts]

    def sleep(self):
        pass

    def wake_up(self):
        pass


def test_a_tool_call_runs_and_the_answer_ends_the_trajectory(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "rollout.tools=[builtin:calculator]",
            "rollout.max_turns=4",
            "rollout.max_total_tokens=400",
            "rollout.max_new_tokens=120",
            "data.max_prompt_tokens=16",
        ],
    )
    dispatch = make_dispatch(cfg, ScriptedEngine(tokenizer), GROUPS, tokenizer)
    prompt = SimpleNamespace(index=0, token_ids=tokenizer.encode("6*7="), columns={"answer": "42"})
    (rollout,) = dispatch.generate([prompt], 2, step=0)
    for t in rollout.sampled:
        assert [m["role"] for m in t.messages] == ["assistant", "tool", "assistant"]
        assert t.messages[1] == {"role": "tool", "name": "calculator", "content": "42"}
        assert t.finish == "done" and t.turns == 2 and (t.tool_calls, t.tool_errors) == (1, 0)
        observation = tokenizer.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m == 0])
        assert observation == "\ntool: 42\nassistant: "  # the tiny template's rendering, after the turn
    greedy = rollout.greedy
    assert "not valid JSON" in greedy.messages[1]["content"] and (greedy.tool_calls, greedy.tool_errors) == (1, 1)
    stats = trajectory_stats([rollout])
    assert stats["tool_calls"] == 3 and stats["tool_errors"] == 1 and stats["done"] == 3
    assert stats["tool_seconds"] > 0  # time/tools_s: the calculator's calls, timed
    json.dumps(greedy.messages)  # the dump writes them as they are
