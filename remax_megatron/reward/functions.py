"""Rule-based reward functions: a registry, user functions by dotted path, a weighted sum.

A reward function is called once per batch of responses, in one of two conventions, told apart by
its signature (a parameter named `completions` makes it TRL's):

    fn(prompts, responses, **columns) -> list[float]          # this project's: two positional lists
    fn(completions, **kwargs) -> list[float]                   # TRL's: keywords only

this project's: `prompts` are the prompts as the model saw them (after the chat template), `responses`
the decoded responses; TRL's (GRPOTrainer's call, as is): `prompts` are the dataset's prompt values
(strings, or message lists), `completions` the responses (strings, or [{"role": "assistant",
"content": ...}] when the prompts are message lists), `completion_ids` their token ids. Both get
the dataset's other columns as keywords (data.answer_key's also as `answer`), aligned with the
responses; a function without **kwargs gets only the keywords it names. One number per response;
None (TRL: "not applicable") counts 0. User functions are named `package.module:function`.
Built-ins: exact_match, numeric_match, format (regex), length_penalty.

Every function is called once at start-up on the first rows with a placeholder completion (`probe`):
a wrong signature, count or type is one line before any model is built. Every result is checked
during training too: wrong count, non-numbers, NaN/inf, or an exception become a one-line RewardError
naming the function and the prompt index (the scorer then stops every rank with it; the first rank
that saw it prints it).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The contract, as errors, --help and the README state it.
CONTRACT = (
    "a reward function is fn(prompts, responses, **columns) (this project's: two positional lists) or "
    "TRL's fn(completions, **kwargs) (keywords: prompts, completions, completion_ids and the dataset's "
    "columns), returning one number per response"
)
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def contract_help() -> str:
    """The contract as `python -m remax_megatron.train --help` shows it (this module's docstring, from its
    first convention to the start-up call)."""
    doc = __doc__.split("\n\n", 1)[1].split("Every result is checked")[0]
    return "reward functions (reward.functions = [name or package.module:function, ...]):\n" + "\n".join(
        "  " + line if line else "" for line in doc.strip().splitlines()
    )


PLACEHOLDER = "0"  # the completion of the start-up call

REGISTRY: dict[str, Callable] = {}


class RewardError(ValueError):
    """A reward function raised or returned something unusable; one line naming it and the prompt.

    `where` (" (on prompt 11)"): the prompt it happened on, appended to the message; `bare` is the
    message without it (the start-up call names its rows itself). `report`: whether this rank prints
    it (the scorer sets it on the first rank that saw the failure; every other rank raises it too,
    silently, so that the whole job stops together)."""

    def __init__(self, message: str, where: str = "", report: bool = True):
        super().__init__(message + where)
        self.bare, self.report = message, report


def register(name: str):
    def wrap(fn):
        REGISTRY[name] = fn
        return fn

    return wrap


def _normalize(text: str) -> str:
    return " ".join(str(text).strip().split())


@register("exact_match")
def exact_match(prompts, responses, answer, **_):  # noqa: ARG001 - the contract's (prompts, responses)
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
def numeric_match(prompts, responses, answer, tolerance: float = 1e-6, **_):  # noqa: ARG001 - the contract's (prompts, responses)
    """1.0 when the last number of the response equals the numeric answer within a relative tolerance."""
    out = []
    for r, a in zip(responses, answer):
        got, want = last_number(r), last_number(str(a))
        ok = got is not None and want is not None and abs(got - want) <= tolerance * max(1.0, abs(want))
        out.append(float(ok))
    return out


@register("format")
def format_match(prompts, responses, pattern: str = r"^\s*-?\d+\s*$", **_):  # noqa: ARG001 - the contract's (prompts, responses)
    """1.0 when the response matches the regex `reward.format_pattern` (re.search), else 0.0."""
    regex = re.compile(pattern)
    return [float(bool(regex.search(r))) for r in responses]


@register("length_penalty")
def length_penalty(prompts, responses, limit: int = 256, **_):  # noqa: ARG001 - the contract's (prompts, responses)
    """-(chars over `reward.length_limit`) / limit, 0 within the limit."""
    return [-max(0, len(r) - limit) / limit for r in responses]


def resolve(spec: str) -> Callable:
    """A registry name or `package.module:function` -> the callable; one-line errors."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward function {spec!r} is not built in ({', '.join(sorted(REGISTRY))}) and is "
            "not a 'package.module:function' path"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name} has no callable {attr!r}")
    return fn


@dataclass
class RewardBatch:
    """What reward functions score: one entry per response, each list aligned with `responses`."""

    prompts: list[str]  # as the model saw them (after the chat template)
    responses: list[str]  # decoded
    columns: dict[str, list] = field(default_factory=dict)  # the dataset's other columns (and `answer`)
    prompt_index: list[int] = field(default_factory=list)  # names the prompt in errors
    raw_prompts: list | None = None  # the dataset's prompt values (TRL's `prompts`); None: `prompts`
    completion_ids: list[list[int]] | None = None
    chat: bool = False  # the prompts are message lists: TRL's completions are too

    def __len__(self) -> int:
        return len(self.responses)

    def item(self, i: int) -> RewardBatch:
        """The batch of response i alone (to name the response a function fails on)."""

        def one(v):
            return v[i : i + 1] if isinstance(v, list) and len(v) == len(self) else v

        return RewardBatch(
            self.prompts[i : i + 1],
            self.responses[i : i + 1],
            {k: one(v) for k, v in self.columns.items()},
            self.prompt_index[i : i + 1],
            one(self.raw_prompts),
            one(self.completion_ids),
            self.chat,
        )


def convention(fn: Callable) -> str:
    """ "trl" when the signature names `completions` (TRL's keyword call), else "remax" (positional)."""
    try:
        return "trl" if "completions" in inspect.signature(fn).parameters else "remax"
    except (TypeError, ValueError):  # not introspectable (a builtin): the positional call
        return "remax"


def required_columns(fn: Callable) -> list[str]:
    """The dataset columns `fn`'s signature requires (keywords without a default, beyond the ones its
    convention passes itself: (prompts, responses), or TRL's prompts / completions / completion_ids)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # not introspectable: nothing known to be required
        return []
    if convention(fn) == "remax":
        params = params[2:]
    return [
        p.name
        for p in params
        if p.name not in TRL_ARGUMENTS and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


class RewardFunction:
    """One reward function and its call (its convention, read from its signature)."""

    BUILTIN_OPTIONS = {"numeric_match": ("tolerance",), "format": ("pattern",), "length_penalty": ("limit",)}

    def __init__(self, spec: str, options: dict | None = None):
        self.spec, self.fn = spec, resolve(spec)
        self.convention = convention(self.fn)
        # Options of the built-ins (format pattern, numeric tolerance, length limit).
        self.options = {k: (options or {})[k] for k in self.BUILTIN_OPTIONS.get(spec, ()) if k in (options or {})}
        try:
            params = inspect.signature(self.fn).parameters.values()
            self.accepts = None if any(p.kind == p.VAR_KEYWORD for p in params) else {p.name for p in params}
        except (TypeError, ValueError):
            self.accepts = None

    def __call__(self, batch: RewardBatch):
        if self.convention == "remax":
            return self.fn(batch.prompts, batch.responses, **batch.columns, **self.options)
        completions = (
            [[{"role": "assistant", "content": r}] for r in batch.responses] if batch.chat else list(batch.responses)
        )
        kwargs = {
            **batch.columns,
            "prompts": batch.raw_prompts if batch.raw_prompts is not None else batch.prompts,
            "completions": completions,
            "completion_ids": batch.completion_ids,
        }
        if self.accepts is not None:  # no **kwargs: the keywords it names
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        return self.fn(**kwargs)


class RewardFunctions:
    """The weighted sum of several reward functions, with every result checked."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] = (), options: dict | None = None):
        self.specs = list(specs)
        self.functions = [RewardFunction(s, options) for s in self.specs]
        self.weights = list(weights) or [1.0] * len(self.functions)

    def __call__(
        self, prompts: list[str], responses: list[str], columns: dict[str, list], prompt_index: list[int], **batch
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Weighted total per response, and each function's raw values (for metrics). `batch`: the
        other fields of RewardBatch (raw_prompts, completion_ids, chat)."""
        return self.score(RewardBatch(prompts, responses, columns, prompt_index, **batch))

    def score(self, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]]]:
        total = [0.0] * len(batch)
        parts = {}
        for fn, weight in zip(self.functions, self.weights):
            values = call_checked(fn, batch)
            parts[fn.spec] = values
            total = [t + weight * v for t, v in zip(total, values)]
        return total, parts

    def probe(self, batch: RewardBatch, where: str) -> None:
        """Call every function once on `batch` (the first rows with a placeholder completion, `where`
        names them): a wrong signature, count or type is a ValueError naming the contract, before any
        model is built."""
        for fn in self.functions:
            try:
                call_checked(fn, batch)
            except RewardError as e:
                raise ValueError(
                    f"{e.bare} at start-up (called on {where} with the placeholder completion "
                    f"{PLACEHOLDER!r}); {CONTRACT}"
                ) from None


def call_checked(fn: RewardFunction, batch: RewardBatch) -> list[float]:
    """fn(batch) with its output checked; errors name the prompt index."""
    name, index = fn.spec, batch.prompt_index
    try:
        values = fn(batch)
    except Exception as e:
        # Find the first prompt it fails on, to name it.
        bad = _first_failing(fn, batch)
        where = f"prompt {index[bad]}" if bad is not None else "this batch"
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}", f" (on {where})") from None
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardError(
            f"reward function {name!r} must return a list of numbers, one per response, got {type(values).__name__}"
        )
    if len(values) != len(batch):
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {len(batch)} responses",
            f" (prompts {index[0]}..{index[-1]})",
        )
    out = []
    for i, v in enumerate(values):
        if v is None:  # TRL's "not applicable": counts 0, as in its nansum over functions
            out.append(0.0)
            continue
        if not _is_number(v):
            raise RewardError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}), not a number", f" for prompt {index[i]}"
            )
        v = float(v)
        if not math.isfinite(v):
            raise RewardError(
                f"reward function {name!r} returned {v}",
                f" for prompt {index[i]} (response {batch.responses[i][:60]!r})",
            )
        out.append(v)
    return out


def _is_number(v) -> bool:
    """int, float, bool, numpy / torch scalars (float() works); not a string, even "1.0"."""
    if isinstance(v, (str, bytes)):
        return False
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _first_failing(fn: RewardFunction, batch: RewardBatch) -> int | None:
    for i in range(len(batch)):
        try:
            fn(batch.item(i))
        except Exception:
            return i
    return None
