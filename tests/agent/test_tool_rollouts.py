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
    """Turn 1: the sampled rows say `call`, the greedy row `greedy` (by default: every row calls the calculator,
    the greedy row with malformed JSON); later turns: `answer`."""

    name = "scripted"

    def __init__(self, tokenizer, call=CALL, greedy="<tool_call>{oops</tool_call>", answer="42"):
        super().__init__()
        self.tokenizer, self.call, self.greedy, self.answer = tokenizer, call, greedy, answer

    def _completion(self, text):
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Completion(ids, [-0.5] * len(ids), "stop")

    def _generate(self, prompts, n, sampling, seeds):
        return [
            PromptRollout([self._completion(self.call) for _ in range(n)], self._completion(self.greedy))
            for _ in prompts
        ]

    def _generate_rows(self, contexts, greedy, sampling, seeds, limits):
        return [self._completion(self.answer) for _ in contexts]

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


# Mistral's habits (its own files are not on this machine): [TOOL_CALLS] and [TOOL_RESULTS] are special tokens,
# a tool message without a 9-character tool_call_id is refused, results follow the turn's </s> directly.
MISTRAL_LIKE = (
    "{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}{{- bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and m == users[-1] %}{{- '[AVAILABLE_TOOLS] ' + tools|tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{- ' ' + m.content|trim + eos_token }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    '{{- \'[TOOL_RESULTS] {"content": \' + m.content|string + \', "call_id": "\' + m.tool_call_id }}'
    "{{- '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)
MISTRAL_CALL = '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}}]</s>'


def test_mistral_tool_calls_run_through_their_special_token_and_results_carry_call_ids(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]})
    tokenizer.chat_template = MISTRAL_LIKE
    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "rollout.tools=[builtin:calculator]",
            "rollout.tool_parser=mistral",
            "rollout.max_turns=4",
            "rollout.max_total_tokens=400",
            "rollout.max_new_tokens=120",
            "data.max_prompt_tokens=16",
        ],
    )
    # the samples call the calculator the Mistral way, greedy answers at once
    engine = ScriptedEngine(tokenizer, call=MISTRAL_CALL, greedy="7</s>", answer=" 42</s>")
    dispatch = make_dispatch(cfg, engine, GROUPS, tokenizer)
    prompt = SimpleNamespace(index=0, token_ids=tokenizer.encode("6*7="), columns={"answer": "42"})
    (rollout,) = dispatch.generate([prompt], 2, step=0)
    for t in rollout.sampled:
        assert t.finish == "done" and t.turns == 2 and (t.tool_calls, t.tool_errors) == (1, 0), t.error
        assert t.messages[1] == {"role": "tool", "name": "calculator", "content": "42", "tool_call_id": "call00001"}
        observation = tokenizer.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m == 0])
        assert observation == '[TOOL_RESULTS] {"content": 42, "call_id": "call00001"}[/TOOL_RESULTS]'
    assert rollout.greedy.finish == "done" and rollout.greedy.turns == 1 and rollout.greedy.tool_calls == 0
