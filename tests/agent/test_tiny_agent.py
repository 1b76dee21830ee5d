"""The built-in agent's pieces that need no model: the builtin:multiply task, the tool-using variant of the
character tokenizer (its chat template renders tools=, <tool_call> survives decoding), and the warm start's
transcripts, which must be exactly the tokens a rollout builds: the warm start would otherwise teach a format
that rollouts never produce (the guard: the transcript with a wrong glue or a trained observation fails)."""

import copy
from types import SimpleNamespace

import pytest

from remax_megatron.agent.tool_env import parse_hermes
from remax_megatron.builtin.agent import guess, tool_call_text, tool_schemas, transcript
from remax_megatron.builtin.tasks import builtin_task
from remax_megatron.builtin.tokenizer import build_tokenizer
from remax_megatron.config import load_config
from remax_megatron.data.prompts import load_prompts
from remax_megatron.reward.functions import numeric_match
from remax_megatron.rollout import Completion, PromptRollout, RolloutEngine
from remax_megatron.rollout.agent import make_dispatch, scored_text

GROUPS = SimpleNamespace(dp_size=1, dp_rank=0, mp_size=1, mp_rank=0)


def test_the_multiply_split_is_deterministic_disjoint_and_four_digit():
    a = builtin_task("multiply")
    assert a == builtin_task("multiply") and (len(a["train"]), len(a["eval"])) == (4524, 100)
    train, held = {r["prompt"] for r in a["train"]}, {r["prompt"] for r in a["eval"]}
    assert not train & held and len(train | held) == 68 * 68
    for r in a["train"] + a["eval"]:
        x, y = map(int, r["prompt"].split("*"))
        assert 32 <= x <= 99 and 32 <= y <= 99 and r["answer"] == str(x * y) and len(r["answer"]) == 4


def test_the_tool_tokenizer_keeps_tool_calls_through_decoding():
    tok = build_tokenizer(tools=True)
    call = tool_call_text("37*58")
    ids = tok.encode(call, add_special_tokens=False)
    assert len(ids) == 33 and ids[0] == tok.convert_tokens_to_ids("<tool_call>")  # one token, as Qwen's
    text = tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True)  # what the tool parser reads
    assert text == call and parse_hermes(text) == [{"name": "calculator", "arguments": {"expression": "37*58"}}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "37*58"}], tools=tool_schemas(), tokenize=False)
    assert rendered == "tools: calculator\nuser: 37*58\n"
    plain = build_tokenizer()  # the arith models' tokenizer is unchanged: characters only
    assert len(plain) == len(tok) - 11 and "calculator" not in plain.apply_chat_template(
        [{"role": "user", "content": "1"}], tools=tool_schemas(), tokenize=False
    )


class WarmStartEngine(RolloutEngine):
    """Emits the warm start's own turns, as an engine does (token ids ending with </s>, finish "stop"): the
    sampled rows call the tool, the greedy row guesses; later turns answer with the number they were told."""

    name = "warm-start"

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def _completion(self, text):
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop")

    def _generate(self, prompts, n, sampling, seeds):
        out = []
        for ids in prompts:
            question = self.tokenizer.decode(ids).split("user: ")[1].split("\n")[0]
            out.append(
                PromptRollout([self._completion(tool_call_text(question))] * n, self._completion(guess(question)))
            )
        return out

    def _generate_rows(self, contexts, greedy, sampling, seeds, limits):
        return [self._completion(self.tokenizer.decode(c).split("tool: ")[-1].split("\n")[0]) for c in contexts]

    def sleep(self):
        pass

    def wake_up(self):
        pass


@pytest.fixture(scope="module")
def agent_run():
    """The agent default's prompts as the trainer tokenizes them, rolled out through the tool loop."""
    tok = build_tokenizer(tools=True)
    cfg = load_config("configs/tiny_cpu_agent.yaml", ["rollout.engine=native"])
    _, eval_prompts, _ = load_prompts(cfg.data, tok, cfg.reward.functions, tools=tool_schemas())
    prompts = eval_prompts[:3]
    rollouts = make_dispatch(cfg, WarmStartEngine(tok), GROUPS, tok).generate(prompts, 2, step=0)
    return tok, prompts, rollouts


def test_warm_start_transcripts_are_the_tokens_of_a_rollout(agent_run):
    tok, prompts, rollouts = agent_run
    for q, r in zip(prompts, rollouts):
        question = tok.decode(q.token_ids).split("user: ")[1].split("\n")[0]  # "33*40"
        for trajectory, use_tool in ((r.sampled[0], True), (r.greedy, False)):
            ids, labels = transcript(tok, question, use_tool)
            assert q.token_ids + trajectory.token_ids == ids
            assert [0] * len(q.token_ids) + trajectory.loss_mask == [int(label != -100) for label in labels]
        assert r.sampled[0].turns == 2 and r.sampled[0].tool_calls == 1 and r.greedy.turns == 1


def test_reward_turns_last_scores_the_final_answer_not_the_tools(agent_run):
    """reward.turns: `all` scores the transcript, where the calculator's message holds the answer too; `last`
    the final assistant turn. The tiny agent scored on the transcript learned, at step ~38, to follow the
    calculator's answer with a junk call: numeric_match gave it 1 (the last number was the tool's)."""
    tok, prompts, rollouts = agent_run
    answers = [q.columns["answer"] for q in prompts for _ in range(2)]
    for turns in ("all", "last"):
        texts = [scored_text(t, tok, turns) for r in rollouts for t in (r.sampled[0], r.greedy)]
        assert numeric_match(None, texts, answers) == [1.0, 0.0] * len(prompts)
    assert scored_text(rollouts[0].sampled[0], tok, "last") == answers[0]
    hack = copy.deepcopy(rollouts[0].sampled[0])  # the call, the tool's answer, then a junk call
    hack.messages[-1]["content"] = '<tool_call>{"}}}}</tool_call>'
    hack.token_ids = hack.token_ids[: -len(tok.encode(answers[0])) - 1] + tok.encode(hack.messages[-1]["content"])
    assert numeric_match(None, [scored_text(hack, tok, "all")], answers[:1]) == [1.0]
    assert numeric_match(None, [scored_text(hack, tok, "last")], answers[:1]) == [0.0]
    single = Completion(tok.encode("2146"), [0.0] * 4, "stop")  # a single-turn response is its last turn
    assert scored_text(single, tok, "last") == scored_text(single, tok, "all") == "2146"
