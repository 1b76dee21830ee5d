"""Multi-turn rollouts (rollout/agent.py) on the native engine, in one process: a trajectory's ids are the
engine's outputs and the observation deltas (never re-tokenized), every prompt builds n + 1 environments from
equal rows, the greedy trajectory is argmax decoding turn by turn, environment failures end only their
trajectory, the bounds end trajectories as named, and observations never reach the loss."""

from types import SimpleNamespace

import jinja2
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from remax_megatron.batching import pad_sequences
from remax_megatron.config import load_config
from remax_megatron.data.prompts import Prompt
from remax_megatron.rollout import Completion
from remax_megatron.rollout.agent import AgentDispatch, ChatDelta, Trajectory, load_env
from tests.rollout import agent_envs
from tests.rollout.helpers import native_engine

GROUPS = SimpleNamespace(dp_size=1, dp_rank=0, mp_size=1, mp_rank=0)
ENVS = "tests.rollout.agent_envs"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return native_engine(tiny_llama, seed=3)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _rollout_cfg(env="CounterEnv", max_prompt_tokens=8, **over):
    keys = {"max_turns": 3, "max_total_tokens": 64, "max_new_tokens": 5, "n": 2, "temperature": 1.0, **over}
    sets = [f"rollout.env={ENVS}:{env}", f"data.max_prompt_tokens={max_prompt_tokens}"]
    return load_config(None, sets + [f"rollout.{k}={v}" for k, v in keys.items()]).rollout


def _prompts(tokenizer, answers=(3, 8, 2)):
    return [
        Prompt(index=i, text=f"{a - 1}+1=", token_ids=tokenizer.encode(f"{a - 1}+1="), columns={"answer": str(a)})
        for i, a in enumerate(answers)
    ]


def _dispatch(engine, tokenizer, env="CounterEnv", **over):
    cfg = _rollout_cfg(env, **over)
    return AgentDispatch(engine, GROUPS, cfg, 0, tokenizer, load_env(cfg.env), error_reward=-1.0)


class DoublingTokenizer:
    """decode doubles every character, so encode(decode(ids)) != ids: generated text must never be re-encoded."""

    chat_template = None

    def __init__(self, base):
        self.base = base

    def decode(self, ids, skip_special_tokens=True):
        return "".join(c * 2 for c in self.base.decode(ids, skip_special_tokens=skip_special_tokens))

    def encode(self, text, add_special_tokens=True):
        return self.base.encode(text, add_special_tokens=add_special_tokens)


def _spy(engine, monkeypatch):
    """Every engine call's inputs and outputs: ("generate", prompts, rollouts) / ("rows", contexts, completions)."""
    calls = []
    generate, rows = engine.generate, engine.generate_rows

    def spy_generate(prompts, n, sampling, seeds=None):
        out = generate(prompts, n=n, sampling=sampling, seeds=seeds)
        calls.append(("generate", [list(p) for p in prompts], out))
        return out

    def spy_rows(contexts, greedy, sampling, seeds, max_new_tokens=None):
        out = rows(contexts, greedy, sampling, seeds, max_new_tokens)
        calls.append(("rows", [list(c) for c in contexts], out, list(greedy)))
        return out

    monkeypatch.setattr(engine, "generate", spy_generate)
    monkeypatch.setattr(engine, "generate_rows", spy_rows)
    return calls


def test_a_trajectory_is_the_engines_outputs_and_the_observation_deltas(engine, tokenizer, monkeypatch):
    doubling = DoublingTokenizer(tokenizer)
    dispatch = _dispatch(engine, doubling)
    calls = _spy(engine, monkeypatch)
    prompts = _prompts(tokenizer)
    rollouts = dispatch.collect(dispatch.submit(prompts, 2, step=4))
    generate = [c for c in calls if c[0] == "generate"]
    rows = [c for c in calls if c[0] == "rows"]
    assert len(generate) == 1 and len(rows) == 2  # one request per turn, greedy rows in it
    reencoded = 0
    for q, r in zip(prompts, rollouts):
        for j, t in enumerate(r.sampled + [r.greedy]):
            assert isinstance(t, Trajectory) and t.turns == 3 and t.finish == "done"
            first = (generate[0][2][q.index].sampled + [generate[0][2][q.index].greedy])[j]
            expect, mask = list(first.token_ids), [1] * len(first.token_ids)
            logprobs = list(first.logprobs)
            for turn, (_, contexts, outs, greedy) in enumerate(rows, start=2):
                delta = tokenizer.encode(f" #{turn - 1} ", add_special_tokens=False)
                expect += delta
                mask += [0] * len(delta)
                logprobs += [0.0] * len(delta)
                k = contexts.index(q.token_ids + expect)  # this trajectory's row of the turn
                assert greedy[k] == (j == 2)
                expect += outs[k].token_ids
                mask += [1] * len(outs[k].token_ids)
                logprobs += outs[k].logprobs
                reencoded += doubling.encode(doubling.decode(outs[k].token_ids), False) != outs[k].token_ids
            assert t.token_ids == expect and t.loss_mask == mask and t.logprobs == logprobs
            assert t.observation_tokens == mask.count(0) and t.env_reward is not None
    assert reencoded > 0  # the tokenizer really is not the identity on these outputs


def test_every_prompt_builds_n_plus_1_equal_environments_and_greedy_is_argmax_each_turn(engine, tokenizer, tiny_llama):
    agent_envs.RecordingEnv.log.clear()
    dispatch = _dispatch(engine, tokenizer, "RecordingEnv", max_new_tokens=4)
    prompts = _prompts(tokenizer)
    rollouts = dispatch.collect(dispatch.submit(prompts, 2, step=0))
    inits = [e for e in agent_envs.RecordingEnv.log if e[0] == "init"]
    assert len(inits) == len(prompts) * 3
    for p, q in enumerate(prompts):
        assert [cols for _, _, cols in inits[p * 3 : p * 3 + 3]] == [q.columns] * 3
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for q, r in zip(prompts, rollouts):
        g = r.greedy
        at = 0
        for turn in range(g.turns):  # each turn's generated run of the loss mask
            end = at
            while end < len(g.loss_mask) and g.loss_mask[end] == 1:
                end += 1
            context = torch.tensor([q.token_ids + g.token_ids[:at]])
            with torch.no_grad():
                out = hf.generate(
                    context, max_new_tokens=4, do_sample=False, eos_token_id=sorted(engine.eos_token_ids) or None
                )
            want = out[0, context.shape[1] :].tolist()
            assert g.token_ids[at:end] == want[: end - at] and (end - at == 4 or end - at == len(want)), (turn, want)
            at = end
            while at < len(g.loss_mask) and g.loss_mask[at] == 0:
                at += 1
    steps = [e for e in agent_envs.RecordingEnv.log if e[0] == "step"]
    assert len(steps) == sum(t.turns for r in rollouts for t in r.sampled + [r.greedy])


def test_an_environment_that_raises_or_hangs_ends_only_its_trajectory(engine, tokenizer):
    dispatch = _dispatch(engine, tokenizer, "FlakyEnv", env_timeout_s=1)
    prompts = _prompts(tokenizer, answers=(3, 8, 2))  # 3: raises at turn 2; 8: hangs at turn 2; 2: runs on
    rollouts = dispatch.collect(dispatch.submit(prompts, 1, step=0))
    finishes = [[t.finish for t in r.sampled + [r.greedy]] for r in rollouts]
    assert finishes == [["env_error"] * 2, ["env_error"] * 2, ["done"] * 2]
    assert "tool crashed" in rollouts[0].greedy.error and "timed out" in rollouts[1].greedy.error
    assert [t.turns for r in rollouts for t in r.sampled + [r.greedy]] == [2, 2, 2, 2, 3, 3]
    assert rollouts[0].greedy.env_reward == 0.0  # reward() still scores what it saw


def test_the_bounds_end_trajectories_as_named(engine, tokenizer):
    prompts = _prompts(tokenizer, answers=(3,))
    # max_turns below the environment's 3 turns
    (r,) = _dispatch(engine, tokenizer, max_turns=2).generate(prompts, 1, step=0)
    assert [t.finish for t in r.sampled + [r.greedy]] == ["max_turns"] * 2 and r.greedy.turns == 2
    # max_total: room for the first turn, not for every observation after it
    start = len(prompts[0].token_ids)
    bounded = _dispatch(engine, tokenizer, max_prompt_tokens=start, max_total_tokens=start + 9, max_new_tokens=5)
    (r,) = bounded.generate(prompts, 1, step=0)
    for t in r.sampled + [r.greedy]:
        assert t.finish == "max_total" and start + len(t.token_ids) <= start + 9 and t.finish_reason == "length"


def test_observations_leave_the_loss(tokenizer):
    t = Trajectory(token_ids=[5, 6, 7, 8, 9], logprobs=[-1.0, -2.0, 0.0, 0.0, -3.0], finish_reason="stop")
    t.loss_mask = [1, 1, 0, 0, 1]
    plain = Completion([5, 6, 7, 8, 9], [-1.0, -2.0, -0.5, -0.5, -3.0], "stop")
    batch = pad_sequences([[1, 2], [1, 2]], [t, plain], pad_id=0)
    assert batch["labels"][0].tolist() == [-100, 5, 6, -100, -100, 9, -100]
    assert batch["response_mask"][0].tolist() == [False, True, True, False, False, True, False]
    assert batch["response_mask"][1].sum() == 5 and batch["engine_logprobs"][0, 3:5].tolist() == [0.0, 0.0]
    t.loss_mask = [1, 1]
    with pytest.raises(ValueError, match="row 0: 5 tokens but a loss mask of 2"):
        pad_sequences([[1, 2]], [t], pad_id=0)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_observation_is_the_templates_delta_after_the_turn(tokenizer):
    templated = SimpleNamespace(
        chat_template=CHATML,
        apply_chat_template=lambda messages, tokenize, add_generation_prompt: _render(messages, add_generation_prompt),
        encode=lambda text, add_special_tokens=True: [ord(c) for c in text],
        decode=lambda ids, skip_special_tokens=False: "".join(chr(i) for i in ids),
    )
    chat = ChatDelta(templated)
    tool = [{"role": "tool", "content": "42"}]
    ended = [ord(c) for c in "ok"] + [ord(c) for c in "<|im_end|>"]  # a turn that generated its end marker
    assert (
        "".join(map(chr, chat.observation(tool, ended))) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    cut = [ord(c) for c in "ok<"]  # a turn cut at max_new_tokens: the whole closing glue comes first
    assert "".join(map(chr, chat.observation("hi", cut, stopped=False))) == (
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = ChatDelta(DoublingTokenizer(tokenizer))  # no template: the observation's text as it is
    assert plain.observation(" #1 ", [5]) == tokenizer.encode(" #1 ", add_special_tokens=False)


# Qwen3's habit (its own template is not on this machine): the last assistant turn after the last user query gets
# an empty think block, an earlier one does not, so adding a message re-renders the turn before it. Tool results
# go in one user turn as <tool_response> blocks.
THINK_ON_LAST = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_re_renders_the_turn_before_still_gives_the_delta_after_it():
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(THINK_ON_LAST)
    qwen3_like = SimpleNamespace(
        chat_template=THINK_ON_LAST,
        apply_chat_template=lambda messages, tokenize, add_generation_prompt: template.render(
            messages=messages, add_generation_prompt=add_generation_prompt
        ),
        encode=lambda text, add_special_tokens=True: [ord(c) for c in text],
        decode=lambda ids, skip_special_tokens=False: "".join(chr(i) for i in ids),
    )
    chat = ChatDelta(qwen3_like)
    turn = [ord(c) for c in '<tool_call>{"name": "calculator"}</tool_call><|im_end|>']
    tools = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "7"}]
    assert "".join(map(chr, chat.observation(tools, turn))) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def _render(messages, generation_prompt):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


@pytest.mark.parametrize(
    "over,message",
    [
        (["rollout.max_total_tokens=96", "rollout.env=no_such_module:Env"], "cannot import it"),
        (["rollout.max_total_tokens=96", f"rollout.env={ENVS}:NotAnEnv"], "has no step"),
        ([f"rollout.env={ENVS}:CounterEnv"], "max_total_tokens=0"),
        ([f"rollout.env={ENVS}:CounterEnv", "rollout.max_total_tokens=10"], "the longest prompt's first turn"),
        ([f"rollout.env={ENVS}:CounterEnv", "rollout.max_total_tokens=96", "rollout.max_turns=0"], "max_turns=0"),
        (["rollout.max_turns=3"], "without rollout.env"),
        (["reward.turns=last"], "reward.turns=last applies to multi-turn rollouts"),
        (["reward.turns=first"], "reward.turns='first' is not one of all, last"),
    ],
)
def test_bad_agent_settings_are_one_line_errors(over, message):
    with pytest.raises(ValueError, match=message) as e:
        cfg = load_config(None, ["reward.functions=[exact_match]", "data.max_prompt_tokens=16", *over])
        load_env(cfg.rollout.env)
    assert "\n" not in str(e.value)


def test_the_guides_worked_example_runs(engine, tokenizer, monkeypatch):
    """docs/guide.md's environment, taken from the guide as it is, through a 2-prompt rollout."""
    import os
    import re
    import sys
    import types

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    guide = open(os.path.join(root, "docs", "guide.md")).read()
    section = guide[guide.index("## Multi-turn rollouts") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("guide_envs")
    exec(compile(code, "docs/guide.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "guide_envs", module)
    cfg = _rollout_cfg("CounterEnv")
    cfg.env = "guide_envs:Guess"
    dispatch = AgentDispatch(engine, GROUPS, cfg, 0, tokenizer, load_env(cfg.env))
    rollouts = dispatch.generate(_prompts(tokenizer, answers=(3, 5)), 2, step=1)
    for r in rollouts:
        for t in r.sampled + [r.greedy]:
            assert t.finish in ("done", "max_turns")
            assert t.env_reward == (1.0 / t.turns if t.finish == "done" else 0.0)
            assert [m["role"] for m in t.messages][:2] == ["assistant", "user"] or t.finish == "done"


def test_reward_functions_receive_each_trajectorys_environment(engine, tokenizer):
    from remax_megatron.reward import RewardFunctions, RewardScorer
    from remax_megatron.rollout.agent import env_columns, env_scores

    prompts = _prompts(tokenizer, answers=(3, 5))
    rollouts = _dispatch(engine, tokenizer, "NoRewardEnv").generate(prompts, 2, step=0)
    assert env_scores(rollouts) is None  # no reward() of its own: the reward functions score
    responses = [[(t.token_ids, "") for t in r.sampled + [r.greedy]] for r in rollouts]
    scorer = RewardScorer(RewardFunctions([f"{ENVS}:turns_reward"], [1.0], {}))
    scores, _ = scorer.score(prompts, responses, response_columns=env_columns(rollouts))
    assert scores == [[2.0] * 3, [2.0] * 3]


def test_an_environment_reply_that_is_not_a_message_ends_only_its_trajectory(engine, tokenizer):
    """What an environment says is hostile input too: a non-message reply, or one the chat template raises on,
    is an env_error of that trajectory; the others run on."""
    tokenizer = _Strict(tokenizer)
    dispatch = _dispatch(engine, tokenizer, "BadReplyEnv")
    rollouts = dispatch.generate(_prompts(tokenizer.base, answers=(3, 8, 2)), 1, step=0)
    (bad, unrenderable, fine) = ([t for t in r.sampled + [r.greedy]] for r in rollouts)
    assert all(t.finish == "env_error" and "as its message(s)" in t.error for t in bad)
    assert all(t.finish == "env_error" and "cannot render" in t.error for t in unrenderable)
    assert all(t.finish == "done" and t.turns == 3 for t in fine)


class _Strict:
    """The tiny tokenizer with a template that raises on a role it does not know (as strict templates do)."""

    def __init__(self, base):
        self.base, self.chat_template = base, "strict"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if any(m["role"] not in ("user", "assistant", "system") for m in messages):
            raise ValueError("roles must alternate user/assistant")
        return self.base.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt)

    def __getattr__(self, name):
        return getattr(self.base, name)
