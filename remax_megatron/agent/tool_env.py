"""Tools as an environment (rollout.tools): each assistant turn's tool calls are run and their results are the
next `tool` messages; a turn without a call ends the trajectory (rollout/agent.py runs the turns).

    env = ToolEnv(tools, parser="hermes", timeout_s=10.0)     # one per trajectory
    messages, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
    # [{"role": "tool", "name": "calculator", "content": "5"}], False

Parsers (rollout.tool_parser), named as vLLM's --tool-call-parser:
- `hermes`, what Qwen2.5 / Qwen3 and Hermes models emit: {"name": ..., "arguments": {...}} inside
  <tool_call>...</tool_call>, anywhere in the turn;
- `llama3_json`, what Llama 3.1-3.3 emit: the whole turn is the call(s), {"name": ..., "parameters": {...}}
  (or "arguments"), several separated by ";", after an optional <|python_tag|>; a turn that does not start
  with "{" is an answer;
- `mistral`, what Mistral's instruct models emit after a [TOOL_CALLS] token: a JSON list of {"name",
  "arguments", "id"} (Mistral-7B-v0.3, Mistral-Nemo, Mixtral-8x22B) or name[CALL_ID]id[ARGS]{...} /
  name[ARGS]{...} per call (Mistral-Small 3.x, Magistral, Devstral). [TOOL_CALLS] is a special token: step()
  gets the turn's text with special tokens kept (`special_tokens`). Each result carries the call's
  `tool_call_id` (the model's own when it gave a 9-character one, else callNNNNN): Mistral's templates refuse
  a tool message without one.
A call that cannot be parsed, names no
known tool or gives arguments that do not fit the tool's schema, and a tool that raises, times out or
returns something other than text, gives the model an error text as that call's result (counted in
`tool_errors`), never an exception. The calls of one turn run side by side, each under timeout_s. A result
longer than max_output_chars keeps its head and tail around a note of what was cut (a traceback's last line
stays in).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor, wait

from remax_megatron.agent.tools import Tool

HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="remax-tool")


def parse_hermes(text: str) -> list[dict | str]:
    """Each <tool_call> block of `text`: {"name", "arguments"}, or the error text of a block that is not one."""
    calls = []
    for block in HERMES.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError as e:
            calls.append(f"error: the tool call is not valid JSON ({e.msg} at position {e.pos})")
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            calls.append('error: a tool call must be {"name": ..., "arguments": {...}}')
            continue
        calls.append({"name": call["name"], "arguments": call.get("arguments") or {}})
    return calls


def parse_llama3_json(text: str) -> list[dict | str]:
    """The calls of a turn that is nothing but JSON calls (Llama 3.x), or [] for an answer."""
    text = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not text.startswith("{"):
        return []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            call, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            return [*calls, f"error: the tool call is not valid JSON ({e.msg} at position {e.pos})"]
        arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('error: a tool call must be {"name": ..., "parameters": {...}}')
        else:
            calls.append({"name": call["name"], "arguments": arguments or {}})
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return [*calls, f"error: text after a tool call: {rest[:50]!r} (separate calls with ';')"]
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls


def parse_mistral(text: str) -> list[dict | str]:
    """Every call after a [TOOL_CALLS] token of `text` (decoded with special tokens): {"name", "arguments"} and
    the model's "id" when it gave one, or the error text of a call that is not one; [] for an answer."""
    calls, decoder = [], json.JSONDecoder()
    for block in text.split("[TOOL_CALLS]")[1:]:
        block = block.strip()
        if block.startswith(("[", "{")):  # [{"name": ..., "arguments": {...}, "id": ...}, ...]
            try:
                value = decoder.raw_decode(block)[0]
            except json.JSONDecodeError as e:
                calls.append(f"error: the tool call is not valid JSON ({e.msg} at position {e.pos})")
                continue
            for call in value if isinstance(value, list) else [value]:
                if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                    calls.append('error: a tool call must be {"name": ..., "arguments": {...}}')
                    continue
                ids = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
                calls.append({"name": call["name"], "arguments": call.get("arguments") or {}, **ids})
            continue
        head, marker, arguments = block.partition("[ARGS]")  # name[CALL_ID]id[ARGS]{...} or name[ARGS]{...}
        name, _, call_id = head.partition("[CALL_ID]")
        if not marker or not name.strip():
            calls.append("error: a tool call must be [TOOL_CALLS]name[ARGS]{...arguments...}")
            continue
        try:
            value = decoder.raw_decode(arguments.strip())[0]
        except json.JSONDecodeError as e:
            calls.append(f"error: the arguments of {name.strip()!r} are not valid JSON ({e.msg} at position {e.pos})")
            continue
        calls.append({"name": name.strip(), "arguments": value, **({"id": call_id.strip()} if call_id else {})})
    return calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


class ToolEnv:
    """The environment of rollout.tools (no reward(): the reward functions score the trajectory)."""

    def __init__(
        self,
        tools: list[Tool],
        parser: str = "hermes",
        timeout_s: float = 10.0,
        max_output_chars: int = 8192,
        **_columns,
    ):
        self.tools = {t.name: t for t in tools}
        self.parse, self.timeout_s, self.max_output_chars = PARSERS[parser], timeout_s, max_output_chars
        # Mistral's [TOOL_CALLS] is a special token (step() must see it: rollout/agent.py), and its templates
        # refuse a tool message without a 9-character tool_call_id
        self.special_tokens = self.call_ids = parser == "mistral"
        self.tool_calls = self.tool_errors = 0
        self.tool_seconds = 0.0

    def step(self, text: str) -> tuple[list[dict] | None, bool]:
        calls = self.parse(text)
        if not calls:  # the model answered without a tool: the episode is over
            return None, True
        start = time.perf_counter()
        futures = [_POOL.submit(self._call, c) if isinstance(c, dict) else None for c in calls]
        wait([f for f in futures if f is not None], timeout=self.timeout_s or None)
        messages = []
        for call, future in zip(calls, futures):
            name = call["name"] if isinstance(call, dict) else "unknown"
            if future is None:
                result = call  # the parser's error text
            elif not future.done():
                result = f"error: {name} timed out after {self.timeout_s} s"
            else:
                result = future.result()
            result = shorten(result, self.max_output_chars)
            self.tool_calls += 1
            self.tool_errors += result.startswith("error:")
            messages.append({"role": "tool", "name": name, "content": result})
            if self.call_ids:
                given = call.get("id", "") if isinstance(call, dict) else ""
                ok = len(given) == 9 and given.isascii() and given.isalnum()
                messages[-1]["tool_call_id"] = given if ok else f"call{self.tool_calls:05d}"
        self.tool_seconds += time.perf_counter() - start
        return messages, False

    def _call(self, call: dict) -> str:
        """One call's result text ("error: ..." when it could not give one)."""
        tool = self.tools.get(call["name"])
        if tool is None:
            return f"error: unknown tool {call['name']!r}; tools: {sorted(self.tools)}"
        problem = check_arguments(tool.schema, call["arguments"])
        if problem:
            return f"error: {tool.name}: {problem}"
        try:
            result = tool.fn(**call["arguments"])
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read, not the run's
            return f"error: {tool.name} raised {type(e).__name__}: {e}"
        if not isinstance(result, str):
            return f"error: {tool.name} returned {type(result).__name__}, not text"
        return result


def shorten(text: str, limit: int) -> str:
    """`text` if it has at most `limit` characters, else its head and tail around a note of how much was cut."""
    if len(text) <= limit:
        return text
    note = f"\n[... {{}} characters cut: tool output is capped at {limit} ...]\n"
    keep = max(limit - len(note.format(len(text))), 0)
    head, tail = keep - keep // 2, keep // 2
    return text[:head] + note.format(len(text) - keep) + (text[-tail:] if tail else "")


def check_arguments(schema: dict, arguments) -> str:
    """What is wrong with `arguments` for a tool's JSON schema ("" when nothing)."""
    params = schema["function"].get("parameters", {})
    if not isinstance(arguments, dict):
        return f"arguments must be an object, got {type(arguments).__name__}"
    properties = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing argument(s) {missing}"
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        return f"unknown argument(s) {unknown}; arguments: {sorted(properties)}"
    for key, value in arguments.items():
        kind = properties[key].get("type")
        python = JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if python is not None and (not isinstance(value, python) or (kind != "boolean" and isinstance(value, bool))):
            return f"argument {key!r} must be a {kind}, got {json.dumps(value)[:50]}"
    return ""
