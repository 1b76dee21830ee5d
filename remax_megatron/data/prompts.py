"""Prompt datasets: JSONL / Parquet / built-in tasks -> tokenized prompts, split, shuffled per epoch.

    train, eval, counts = load_prompts(cfg.data, tokenizer, cfg.reward.functions)
    sampler = PromptSampler(train, seed)           # deterministic per-epoch order
    batch = sampler.next(8)                        # list[Prompt]; sampler.state_dict() for resume
"""

from __future__ import annotations

import inspect
import json
import os
import random
from dataclasses import dataclass, field
from typing import Sequence

from remax_megatron.builtin.tasks import builtin_task
from remax_megatron.reward.functions import resolve


@dataclass
class Prompt:
    index: int                 # position in its split (names the prompt in errors)
    text: str                  # what the model sees (after the chat template)
    token_ids: list[int]
    columns: dict = field(default_factory=dict)  # the other columns (answer, ...)
    source: str = ""           # where the row came from ("data.jsonl:12"): names it in errors


_JSON_KINDS = {str: "string", int: "number", float: "number", bool: "boolean", list: "array", type(None): "null"}


def read_rows(source: str) -> list[tuple[str, dict]]:
    """(where, row) of every row of a JSONL or Parquet file; `where` is `file:line` (JSONL) or
    `file row N` (Parquet, from 1). Rows that are not JSON objects are refused by file and line."""
    if not os.path.isfile(source):
        raise FileNotFoundError(f"data file {source} not found: give a .jsonl or .parquet path or builtin:arith")
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq

        return [(f"{source} row {i + 1}", row) for i, row in enumerate(pq.read_table(source).to_pylist())]
    rows = []
    with open(source) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}:{line_no} is not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    shown = line.strip() if len(line.strip()) <= 40 else line.strip()[:37] + "..."
                    raise ValueError(f"{source}:{line_no} is a JSON {_JSON_KINDS.get(type(row), 'value')} ({shown}), "
                                     'not an object: each line must be like {"prompt": ..., "answer": ...}')
                rows.append((f"{source}:{line_no}", row))
    return rows


def read_records(source: str) -> list[dict]:
    """Rows of a JSONL or Parquet file; `builtin:<task>` rows are handled by load_prompts."""
    return [row for _, row in read_rows(source)]


def _split_sources(cfg) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]], str]:
    if cfg.train.startswith("builtin:"):
        task = builtin_task(cfg.train.split(":", 1)[1])
        return ([(f"{cfg.train} train row {i}", r) for i, r in enumerate(task["train"])],
                [(f"{cfg.train} eval row {i}", r) for i, r in enumerate(task["eval"])], cfg.train)
    train = read_rows(cfg.train)
    if cfg.eval:
        return train, read_rows(cfg.eval), cfg.train
    # Held-out split: a fixed slice after a seeded shuffle (independent of trainer.seed).
    order = list(range(len(train)))
    random.Random(1234).shuffle(order)
    held = set(order[: min(cfg.eval_size, max(0, len(train) - 1))])
    return ([r for i, r in enumerate(train) if i not in held],
            [r for i, r in enumerate(train) if i in held], cfg.train)


def required_columns(reward_functions: Sequence[str]) -> dict[str, list[str]]:
    """{column: [reward functions that need it]}: the parameters after (prompts, responses) that a
    function's signature requires (no default). The `answer` parameter is data.answer_key's column."""
    needed: dict[str, list[str]] = {}
    for spec in reward_functions:
        try:
            params = list(inspect.signature(resolve(spec)).parameters.values())[2:]
        except (TypeError, ValueError):   # not introspectable: nothing known to be required
            continue
        for param in params:
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and param.default is param.empty:
                needed.setdefault(param.name, []).append(spec)
    return needed


def load_prompts(cfg, tokenizer, reward_functions: Sequence[str] | None = None
                 ) -> tuple[list[Prompt], list[Prompt], dict]:
    """Tokenized train and eval prompts plus counts (dropped / truncated as too long).

    `reward_functions` (reward.functions) decides which columns every row must have: those the
    functions' signatures require (`answer` is data.answer_key). Without it every row must have
    data.answer_key when that is set.
    """
    train_rows, eval_rows, name = _split_sources(cfg)
    if not train_rows:
        raise ValueError(f"data.train={name} has no rows: give a non-empty dataset")
    first = train_rows[0][1]
    if cfg.prompt_key not in first:
        raise ValueError(f"data.prompt_key={cfg.prompt_key!r} is not a column of {name} "
                         f"(columns: {', '.join(sorted(first))}): set data.prompt_key")
    needs = _needed_columns(cfg, reward_functions)
    if cfg.answer_key and "answer" in needs and cfg.answer_key not in first:
        raise ValueError(f"data.answer_key={cfg.answer_key!r} is not a column of {name} "
                         f"(columns: {', '.join(sorted(first))}): set data.answer_key or data.answer_key=''")
    counts = {}
    train = _tokenize(train_rows, cfg, tokenizer, counts, "train", needs)
    evals = _tokenize(eval_rows, cfg, tokenizer, counts, "eval", needs)
    if not train:
        # The count covers both splits: a held-out eval split comes from the same file.
        dropped_eval = counts["data/eval_dropped_too_long"]
        if dropped_eval == len(eval_rows):
            files = f"{name} and {cfg.eval}" if cfg.eval else name
            what = f"all {len(train_rows) + len(eval_rows)} prompts of {files}" + (" (train and eval)" if eval_rows else "")
        else:
            what = (f"all {len(train_rows)} train prompts of {name} ({dropped_eval} of the {len(eval_rows)} "
                    "eval prompts too)")
        raise ValueError(f"{what} are longer than data.max_prompt_tokens={cfg.max_prompt_tokens}: raise it or set "
                         "data.overlong=truncate")
    return train, evals, counts


def _needed_columns(cfg, reward_functions) -> dict[str, str]:
    """{kwarg name: 'what needs it'} for the columns every row must hold (see load_prompts)."""
    if reward_functions is None:
        return {"answer": "data.answer_key"} if cfg.answer_key else {}
    needs = {col: "reward function " + ", ".join(repr(f) for f in fns)
             for col, fns in required_columns(reward_functions).items()}
    if "answer" in needs and not cfg.answer_key:
        raise ValueError(f"{needs['answer']} needs the answer column but data.answer_key is empty: "
                         "set data.answer_key to the column that holds the answers")
    return needs


def _tokenize(rows, cfg, tokenizer, counts, split, needs) -> list[Prompt]:
    templated = cfg.chat_template and getattr(tokenizer, "chat_template", None)
    out, dropped, truncated = [], 0, 0
    for i, (where, row) in enumerate(rows):
        if cfg.prompt_key not in row:
            raise ValueError(f"{where} lacks the column {cfg.prompt_key!r} (data.prompt_key)")
        for kwarg, who in needs.items():
            column = cfg.answer_key if kwarg == "answer" else kwarg
            if column not in row:
                raise ValueError(f"{where} lacks the column {column!r} that {who} needs: add it or remove the row"
                                 + (", or set data.answer_key='' if no reward function needs it"
                                    if who == "data.answer_key" else ""))
        raw = str(row[cfg.prompt_key])
        if not raw.strip():
            raise ValueError(f"{where} has an empty prompt: remove it or fill it")
        text = (tokenizer.apply_chat_template([{"role": "user", "content": raw}], tokenize=False,
                                              add_generation_prompt=True) if templated else raw)
        ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            if cfg.overlong == "drop":
                dropped += 1
                continue
            ids = ids[-cfg.max_prompt_tokens:]  # keep the end: the question and the generation prompt
            text = tokenizer.decode(ids)
            truncated += 1
        columns = {k: v for k, v in row.items() if k != cfg.prompt_key}
        if cfg.answer_key:
            columns["answer"] = row.get(cfg.answer_key)
        out.append(Prompt(index=i, text=text, token_ids=list(ids), columns=columns, source=where))
    counts[f"data/{split}_prompts"] = len(out)
    counts[f"data/{split}_dropped_too_long"] = dropped
    counts[f"data/{split}_truncated"] = truncated
    return out


class PromptSampler:
    """Endless prompt stream: a fresh seeded permutation each epoch (shuffle=False keeps file order)."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True):
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100003 + epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[Prompt]:
        batch = []
        while len(batch) < count:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.prompts[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        """ValueError (one line) when the saved position is past the end of these prompts: the
        checkpoint was trained on a longer prompt list (another data file, or fewer kept)."""
        if state["position"] > len(self.prompts):
            then = f" of {state['size']}" if "size" in state else ""
            raise ValueError(f"its data-loader position {state['position']}{then} is past the end of the "
                             f"{len(self.prompts)} train prompts loaded now: resume with the data it was trained on, "
                             "or start fresh with checkpoint.resume=none")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
