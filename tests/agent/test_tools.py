"""rollout.tools (remax_megatron/agent/tools.py, tool_env.py): schemas from type hints and docstrings, the
hermes parser, every kind of bad call giving the model an error text (never an exception), calls of one turn
side by side under the time limit, a turn without a call ending the episode, and one-line refusals."""

import json
import re

import pytest

from remax_megatron.agent.tool_env import ToolEnv, check_arguments, parse_hermes, parse_llama3_json, parse_mistral
from remax_megatron.agent.tools import calculator, resolve_tools

FNS = "tests.agent.tool_fns"


def _call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _env(*names, timeout_s=2.0):
    return ToolEnv(resolve_tools([f"{FNS}:{n}" for n in names] + ["builtin:calculator"]), "hermes", timeout_s)


def test_the_calculator_is_arithmetic_only():
    assert calculator("12 * (3 + 4)") == "84" and calculator("7 / 2") == "3.5" and calculator("-2 ** 3") == "-8"
    assert calculator("__import__('os').system('true')").startswith("error: ValueError")
    assert calculator("1 / 0").startswith("error: ZeroDivisionError")
    assert calculator("2 ** 100000").startswith("error: ValueError: exponent 100000")


def test_schemas_come_from_type_hints_and_docstrings():
    (add,) = resolve_tools([f"{FNS}:add"])
    params = add.schema["function"]["parameters"]
    assert add.name == "add" and params["properties"]["a"]["type"] == "integer" and params["required"] == ["a", "b"]


def test_calls_run_and_their_results_are_tool_messages():
    env = _env("add")
    text = "let me add " + _call("add", a=2, b=40) + _call("calculator", expression="6*7")
    messages, done = env.step(text)
    assert not done and messages == [
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "tool", "name": "calculator", "content": "42"},
    ]
    assert env.tool_calls == 2 and env.tool_errors == 0
    assert env.step("The answer is 42.") == (None, True)  # no call: the episode is over


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be {"),
        (_call("nope", a=1), "unknown tool 'nope'"),
        (_call("add", a="1", b=2), "argument 'a' must be a integer"),
        (_call("add", a=True, b=2), "argument 'a' must be a integer"),
        (_call("add", a=1), "missing argument(s) ['b']"),
        (_call("add", a=1, b=2, c=3), "unknown argument(s) ['c']"),
        (_call("fails", x="y"), "fails raised RuntimeError: tool broke"),
        (_call("not_text", x=3), "not_text returned int, not text"),
        (_call("sleeps", seconds=5.0), "sleeps timed out after 1.0 s"),
    ],
)
def test_a_bad_call_gives_the_model_an_error_text(text, error):
    env = _env("add", "fails", "not_text", "sleeps", timeout_s=1.0)
    messages, done = env.step(text)
    assert not done and len(messages) == 1 and messages[0]["content"].startswith("error:")
    assert error in messages[0]["content"] and env.tool_errors == 1 == env.tool_calls


def test_a_long_result_keeps_its_head_and_tail_within_the_cap():
    from remax_megatron.config import load_config
    from remax_megatron.rollout.agent import env_factory_of

    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "data.max_prompt_tokens=16",
            "rollout.max_total_tokens=96",
            f"rollout.tools=[{FNS}:floods]",
            "rollout.tool_max_output_chars=300",
        ],
    )
    env = env_factory_of(cfg)()
    (short,), _ = env.step(_call("floods", chars=300))
    assert len(short["content"]) == 300 and "cut" not in short["content"]  # at the cap: untouched
    (long,), _ = env.step(_call("floods", chars=10_000_000))
    content = long["content"]
    assert len(content) <= 300 and content.startswith("HEAD\n") and content.endswith("\nTAIL")
    note = re.search(r"\n\[\.\.\. (\d+) characters cut: tool output is capped at 300 \.\.\.\]\n", content)
    kept = content[: note.start()] + content[note.end() :]
    assert len(kept) + int(note[1]) == 10**7  # the note counts exactly what is gone
    assert env.tool_calls == 2 and env.tool_errors == 0
    with pytest.raises(ValueError, match=r"rollout.tool_max_output_chars=10 leaves no room"):
        load_config(None, ["rollout.tool_max_output_chars=10"])


def test_a_turns_calls_run_side_by_side():
    env = _env("meets", timeout_s=10.0)
    messages, _ = env.step("".join(_call("meets", who=i) for i in range(4)))
    assert [m["content"] for m in messages] == [f"{i} met" for i in range(4)]


def test_check_arguments_accepts_numbers_for_number():
    schema = {"function": {"parameters": {"properties": {"x": {"type": "number"}}, "required": ["x"]}}}
    assert check_arguments(schema, {"x": 1}) == "" and check_arguments(schema, {"x": 1.5}) == ""
    assert "must be a number" in check_arguments(schema, {"x": "1"})


def test_parse_hermes_reads_every_block():
    assert parse_hermes("no call") == []
    calls = parse_hermes(_call("a", x=1) + " and " + _call("b"))
    assert calls == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]


@pytest.mark.parametrize(
    "text,calls",
    [
        ("The answer is 42.", []),  # an answer: no call
        ('The answer is {"name": "add"}', []),  # JSON inside an answer is not a call (the turn must start with it)
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}', [{"name": "add", "arguments": {"a": 1, "b": 2}}]),
        ('<|python_tag|>{"name": "add", "arguments": {"a": 1}}', [{"name": "add", "arguments": {"a": 1}}]),
        (
            ' {"name": "add", "parameters": {"a": 1}}; {"name": "calculator", "parameters": {"expression": "2"}};',
            [{"name": "add", "arguments": {"a": 1}}, {"name": "calculator", "arguments": {"expression": "2"}}],
        ),
        ('{"name": "add", "parameters": {"a": 1}', ["error: the tool call is not valid JSON"]),
        ('{"tool": "add"}', ['error: a tool call must be {"name"']),
        ('{"name": "add"} and then 42', [{"name": "add", "arguments": {}}, "error: text after a tool call"]),
    ],
)
def test_parse_llama3_json_reads_a_turn_of_calls(text, calls):
    parsed = parse_llama3_json(text)
    assert len(parsed) == len(calls)
    for got, want in zip(parsed, calls):
        assert got == want if isinstance(want, dict) else got.startswith(want)


def test_llama3_json_calls_run_through_the_config():
    from remax_megatron.config import load_config
    from remax_megatron.rollout.agent import env_factory_of

    base = ["reward.functions=[exact_match]", "data.max_prompt_tokens=16", "rollout.max_total_tokens=96"]
    cfg = load_config(None, [*base, f"rollout.tools=[{FNS}:add]", "rollout.tool_parser=llama3_json"])
    env = env_factory_of(cfg)()
    messages, done = env.step('{"name": "add", "parameters": {"a": 2, "b": 40}}; {"name": "add", "parameters": {}}')
    assert not done and messages[0] == {"role": "tool", "name": "add", "content": "42"}
    assert "missing argument(s) ['a', 'b']" in messages[1]["content"] and env.tool_errors == 1
    assert env.step("42") == (None, True)
    assert env.step(_call("add", a=1, b=2)) == (None, True)  # a hermes block is text to llama3_json


ADD = {"name": "add", "arguments": {"a": 1}}


@pytest.mark.parametrize(
    "text,calls",
    [
        ("The answer is 42.</s>", []),  # an answer: no [TOOL_CALLS] token
        ('[{"name": "add", "arguments": {"a": 1}}]', []),  # the token stripped (skip_special_tokens): not a call
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]</s>', [ADD]),  # Mistral-7B-v0.3
        (
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abc123XYZ"}, {"name": "b"}]',  # Nemo, ids
            [{**ADD, "id": "abc123XYZ"}, {"name": "b", "arguments": {}}],
        ),
        ('Let me add. [TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}', [ADD]),  # text first, one object
        ('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]b[ARGS]{}</s>', [ADD, {"name": "b", "arguments": {}}]),  # v11
        ('[TOOL_CALLS]add[CALL_ID]k9Xq2mP0a[ARGS]{"a": 1}</s>', [{**ADD, "id": "k9Xq2mP0a"}]),  # Small 3.1
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}</s>', ["error: the tool call is not valid JSON"]),
        ('[TOOL_CALLS] [{"tool": "add"}]', ['error: a tool call must be {"name"']),
        ("[TOOL_CALLS]add</s>", ["error: a tool call must be [TOOL_CALLS]name[ARGS]"]),
        ('[TOOL_CALLS]add[ARGS]{"a": </s>', ["error: the arguments of 'add' are not valid JSON"]),
    ],
)
def test_parse_mistral_reads_every_call_after_its_token(text, calls):
    parsed = parse_mistral(text)
    assert len(parsed) == len(calls), parsed
    for got, want in zip(parsed, calls):
        assert got == want if isinstance(want, dict) else got.startswith(want)


def test_mistral_results_carry_a_9_character_call_id():
    env = ToolEnv(resolve_tools([f"{FNS}:add"]), "mistral", 2.0)
    assert env.special_tokens  # [TOOL_CALLS] is a special token: step() must see it
    messages, done = env.step(
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 40}, "id": "k9Xq2mP0a"}, '
        '{"name": "add", "arguments": {"a": 1, "b": 1}, "id": "short"}, {"name": "nope"}]</s>'
    )
    assert not done and [m["content"] for m in messages][:2] == ["42", "2"]
    # the model's id when it is one, else callNNNNN (the trajectory's call count): errors carry one too
    assert [m["tool_call_id"] for m in messages] == ["k9Xq2mP0a", "call00002", "call00003"]
    assert env.tool_errors == 1 and "unknown tool 'nope'" in messages[2]["content"]
    assert "tool_call_id" not in _env("add").step(_call("add", a=1, b=2))[0][0]  # hermes: messages as before


@pytest.mark.parametrize(
    "specs,message",
    [
        ([f"{FNS}:undocumented"], "has no usable schema"),
        ([f"{FNS}:untyped"], "has no usable schema"),
        ([f"{FNS}:add", f"{FNS}:add"], "two tools are named 'add'"),
        (["builtin:shell"], "unknown built-in tool 'builtin:shell'"),
        ([f"{FNS}:missing"], "cannot import"),
    ],
)
def test_bad_tools_are_one_line_errors(specs, message):
    with pytest.raises(ValueError, match=message) as e:
        resolve_tools(specs)
    assert "\n" not in str(e.value)


def test_a_bad_parser_or_tools_with_an_env_are_refused():
    from remax_megatron.config import load_config
    from remax_megatron.rollout.agent import env_factory_of

    base = ["reward.functions=[exact_match]", "data.max_prompt_tokens=16", "rollout.max_total_tokens=96"]
    cfg = load_config(None, [*base, "rollout.tools=[builtin:calculator]", "rollout.tool_parser=xml"])
    with pytest.raises(ValueError, match="rollout.tool_parser='xml' is not one of"):
        env_factory_of(cfg)
    with pytest.raises(ValueError, match="rollout.env and rollout.tools are both set"):
        load_config(None, [*base, "rollout.tools=[builtin:calculator]", "rollout.env=a.b:C"])


def test_a_template_that_ignores_tools_is_refused(tiny_llama):
    from transformers import AutoTokenizer

    from remax_megatron.config import load_config
    from remax_megatron.data.prompts import _PromptKinds

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # its template renders no tools
    cfg = load_config(None, ["reward.functions=[exact_match]"]).data
    with pytest.raises(ValueError, match="does not render tools="):
        _PromptKinds(
            cfg, tokenizer, resolve_tools(["builtin:calculator"]) and [resolve_tools(["builtin:calculator"])[0].schema]
        )
