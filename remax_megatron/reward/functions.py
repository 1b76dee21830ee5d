"""Rule-based reward functions: a registry, user functions by dotted path, a weighted sum.

A reward function is called once per batch:

    fn(prompts: list[str], responses: list[str], **columns) -> list[float]   # one per response

where `columns` are the dataset's extra columns (e.g. `answer=[...]`), aligned
with the responses. User functions are named `package.module:function`.
Built-ins: exact_match, numeric_match, format (regex), length_penalty.
Every result is checked: wrong count, non-numbers, NaN/inf, or an exception
become a one-line RewardError naming the function and the prompt index (the
scorer then stops every rank with it; the first rank that saw it prints it).
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable, Sequence

REGISTRY: dict[str, Callable] = {}


class RewardError(ValueError):
    """A reward function raised or returned something unusable; one line naming it and the prompt.

    `report`: whether this rank prints it (the scorer sets it on the first rank that saw the
    failure; every other rank raises it too, silently, so that the whole job stops together)."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


def register(name: str):
    def wrap(fn):
        REGISTRY[name] = fn
        return fn

    return wrap


def _normalize(text: str) -> str:
    return " ".join(str(text).strip().split())


@register("exact_match")
def exact_match(prompts, responses, answer, **_):
    """1.0 when the response equals the answer (whitespace-normalised), else 0.0."""
    return [float(_normalize(r) == _normalize(a)) for r, a in zip(responses, answer)]


_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?")


def last_number(text: str) -> float | None:
    """The last number in `text` (commas allowed as thousands separators), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


@register("numeric_match")
def numeric_match(prompts, responses, answer, tolerance: float = 1e-6, **_):
    """1.0 when the last number of the response equals the numeric answer within a relative tolerance."""
    out = []
    for r, a in zip(responses, answer):
        got, want = last_number(r), last_number(str(a))
        ok = got is not None and want is not None and abs(got - want) <= tolerance * max(1.0, abs(want))
        out.append(float(ok))
    return out


@register("format")
def format_match(prompts, responses, pattern: str = r"^\s*-?\d+\s*$", **_):
    """1.0 when the response matches the regex `reward.format_pattern` (re.search), else 0.0."""
    regex = re.compile(pattern)
    return [float(bool(regex.search(r))) for r in responses]


@register("length_penalty")
def length_penalty(prompts, responses, limit: int = 256, **_):
    """-(chars over `reward.length_limit`) / limit, 0 within the limit."""
    return [-max(0, len(r) - limit) / limit for r in responses]


def resolve(spec: str) -> Callable:
    """A registry name or `package.module:function` -> the callable; one-line errors."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r} is not built in ({', '.join(sorted(REGISTRY))}) and is "
                         "not a 'package.module:function' path")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name} has no callable {attr!r}")
    return fn


class RewardFunctions:
    """The weighted sum of several reward functions, with every result checked."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] = (), options: dict | None = None):
        self.specs = list(specs)
        self.fns = [resolve(s) for s in self.specs]
        self.weights = list(weights) or [1.0] * len(self.fns)
        # Options for the built-ins (format pattern, numeric tolerance, length limit).
        self.options = options or {}

    def _builtin_kwargs(self, spec: str) -> dict:
        keys = {"numeric_match": ("tolerance",), "format": ("pattern",), "length_penalty": ("limit",)}
        return {k: self.options[k] for k in keys.get(spec, ()) if k in self.options}

    def __call__(self, prompts: list[str], responses: list[str], columns: dict[str, list],
                 prompt_index: list[int]) -> tuple[list[float], dict[str, list[float]]]:
        """Weighted total per response, and each function's raw values (for metrics)."""
        total = [0.0] * len(responses)
        parts = {}
        for spec, fn, weight in zip(self.specs, self.fns, self.weights):
            values = call_checked(spec, fn, prompts, responses, {**columns, **self._builtin_kwargs(spec)},
                                  prompt_index)
            parts[spec] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total, parts


def call_checked(name: str, fn: Callable, prompts: list[str], responses: list[str], kwargs: dict,
                 prompt_index: list[int]) -> list[float]:
    """fn(prompts, responses, **kwargs) with its output checked; errors name the prompt index."""
    try:
        values = fn(prompts, responses, **kwargs)
    except Exception as e:
        # Find the first prompt it fails on, to name it.
        bad = _first_failing(fn, prompts, responses, kwargs)
        where = f"prompt {prompt_index[bad]}" if bad is not None else "this batch"
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e} (on {where})") from None
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardError(f"reward function {name!r} must return one float per response, got "
                         f"{type(values).__name__}") from None
    if len(values) != len(responses):
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {len(responses)} responses "
                         f"(prompts {prompt_index[0]}..{prompt_index[-1]})")
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise RewardError(f"reward function {name!r} returned {v} for prompt {prompt_index[i]} "
                             f"(response {responses[i][:60]!r})")
    return values


def _first_failing(fn, prompts, responses, kwargs) -> int | None:
    for i in range(len(responses)):
        one = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == len(responses) else v)
               for k, v in kwargs.items()}
        try:
            fn(prompts[i : i + 1], responses[i : i + 1], **one)
        except Exception:
            return i
    return None
