"""Tools a policy calls during multi-turn rollouts (rollout.tools), and the built-in ones.

    tools = resolve_tools(["builtin:calculator", "my_pkg.tools:search"])   # one-line errors for bad specs
    tools[0].schema                # transformers' get_json_schema: what the chat template's tools= renders
    tools[0].fn(expression="1+2")  # "3"

A tool is a plain function with type hints and a Google-style docstring (an `Args:` section describing every
argument): its JSON schema comes from them (transformers.utils.get_json_schema), as in TRL's `tools=`.
It returns text; what it returns is the `tool` message the model reads next.

Built-ins: `builtin:calculator` (arithmetic, evaluated on the parsed expression, never with eval) and
`builtin:python` (the code runs in remax_megatron.agent.sandbox: a separate process with limits).
"""

from __future__ import annotations

import ast
import importlib
import operator
from collections.abc import Callable
from dataclasses import dataclass

MAX_POWER = 64  # calculator: the largest exponent (2 ** 10 ** 9 would take the rank's memory)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "12 * (3 + 4)"
    """
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        return f"error: {type(e).__name__}: {e}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else str(value)


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponent {right} is larger than {MAX_POWER}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: the program; print the values you need
    """
    from remax_megatron.agent.sandbox import run_python

    return run_python(code)


BUILTIN: dict[str, Callable] = {"calculator": calculator, "python": python}


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


def resolve_tools(specs: list[str]) -> list[Tool]:
    """rollout.tools -> Tools; one-line ValueErrors naming the bad spec."""
    from transformers.utils import get_json_schema

    tools = []
    for spec in specs:
        fn = _resolve(spec)
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"rollout.tools: {spec!r} has no usable schema ({str(e).splitlines()[0]}): give it type hints "
                "and a docstring with an Args: section describing every argument"
            ) from None
        name = schema["function"]["name"]
        if any(t.name == name for t in tools):
            raise ValueError(f"rollout.tools: two tools are named {name!r}: the model calls tools by name")
        tools.append(Tool(name, fn, schema))
    return tools


def _resolve(spec: str) -> Callable:
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN:
            raise ValueError(f"rollout.tools: unknown built-in tool {spec!r}; built-ins: {sorted(BUILTIN)}")
        return BUILTIN[name]
    module_name, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name) if name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.tools: cannot import {spec!r} ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ValueError(f"rollout.tools: {spec!r} is not a function (give package.module:function or builtin:NAME)")
    return fn
