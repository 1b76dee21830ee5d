"""Prompt datasets: JSONL / Parquet / built-in tasks -> tokenized prompts, split, shuffled per epoch.

    train, eval, counts = load_prompts(cfg.data, tokenizer, cfg.reward.functions)
    sampler = PromptSampler(train, seed)           # deterministic per-epoch order
    batch = sampler.next(8)                        # list[Prompt]; sampler.state_dict() for resume

The prompt column (data.prompt_key) of every row holds either a string or a conversation: a list of
{"role": ..., "content": "..."} messages (system turns included; TRL's conversational `prompt`, or a
`messages` column). A dataset holds one kind only (train and eval files together). A string goes
through the tokenizer's chat template as one user turn (after data.system_prompt's system turn when
set), or as it is with data.chat_template=false or a tokenizer without a template; a conversation goes
through the template as it is, with the generation prompt:
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`, and needs a template.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from remax_megatron.builtin.tasks import builtin_task
from remax_megatron.reward.functions import required_columns as columns_needed_by
from remax_megatron.reward.functions import resolve


@dataclass
class Prompt:
    index: int  # position in its split (names the prompt in errors)
    text: str  # what the model sees (after the chat template)
    token_ids: list[int]
    columns: dict = field(default_factory=dict)  # the other columns (answer, ...)
    source: str = ""  # where the row came from ("data.jsonl:12"): names it in errors
    raw: str | list = ""  # the row's prompt value: a string, or a list of {role, content} messages
    messages: list[dict] | None = None  # the conversation the chat template rendered (system turn included);
    # None: the prompt text went in as it is

    @property
    def is_chat(self) -> bool:
        """The row's prompt is a conversation (TRL hands such rows' completions to reward functions as
        [{"role": "assistant", "content": ...}])."""
        return isinstance(self.raw, list)


_JSON_KINDS = {
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
    type(None): "null",
}


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
                    raise ValueError(
                        f"{source}:{line_no} is a JSON {_JSON_KINDS.get(type(row), 'value')} ({shown}), "
                        'not an object: each line must be like {"prompt": ..., "answer": ...}'
                    )
                rows.append((f"{source}:{line_no}", row))
    return rows


def prompt_kind(where: str, value, key: str) -> str:
    """ "text" or "chat" for a row's prompt value; anything else is refused naming the row."""
    expected = f'the prompt column {key!r} must hold a string or a list of {{"role": ..., "content": "..."}} messages'
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{where} has an empty prompt (an empty message list): remove it or fill it")
        for i, message in enumerate(value):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(
                    f"{where}: message {i} of the prompt is {_shown(message)}, not a "
                    f'{{"role": ..., "content": "..."}} object of strings: {expected}'
                )
        return "chat"
    kind = _JSON_KINDS.get(type(value), type(value).__name__)
    raise ValueError(f"{where}: the prompt is a {kind} ({_shown(value)}): {expected}; fix or remove the row")


def _shown(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _split_sources(cfg) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]], str]:
    if cfg.train.startswith("builtin:"):
        task = builtin_task(cfg.train.split(":", 1)[1])
        return (
            [(f"{cfg.train} train row {i}", r) for i, r in enumerate(task["train"])],
            [(f"{cfg.train} eval row {i}", r) for i, r in enumerate(task["eval"])],
            cfg.train,
        )
    train = read_rows(cfg.train)
    if cfg.eval:
        return train, read_rows(cfg.eval), cfg.train
    # Held-out split: a fixed slice after a seeded shuffle (independent of trainer.seed).
    order = list(range(len(train)))
    random.Random(1234).shuffle(order)
    held = set(order[: min(cfg.eval_size, max(0, len(train) - 1))])
    return ([r for i, r in enumerate(train) if i not in held], [r for i, r in enumerate(train) if i in held], cfg.train)


def required_columns(reward_functions: Sequence[str]) -> dict[str, list[str]]:
    """{column: [reward functions that need it]}: the keywords a function's signature requires
    (reward.functions.required_columns). The `answer` parameter is data.answer_key's column."""
    needed: dict[str, list[str]] = {}
    for spec in reward_functions:
        for column in columns_needed_by(resolve(spec)):
            needed.setdefault(column, []).append(spec)
    return needed


def load_prompts(
    cfg, tokenizer, reward_functions: Sequence[str] | None = None, tools: list[dict] | None = None
) -> tuple[list[Prompt], list[Prompt], dict]:
    """Tokenized train and eval prompts plus counts (dropped / truncated as too long).

    `reward_functions` (reward.functions) decides which columns every row must have: those the
    functions' signatures require (`answer` is data.answer_key). Without it every row must have
    data.answer_key when that is set. `tools` (rollout.tools' JSON schemas) go to the chat template.
    """
    train_rows, eval_rows, name = _split_sources(cfg)
    if not train_rows:
        raise ValueError(f"data.train={name} has no rows: give a non-empty dataset")
    first = train_rows[0][1]
    if cfg.prompt_key not in first:
        raise ValueError(
            f"data.prompt_key={cfg.prompt_key!r} is not a column of {name} "
            f"(columns: {', '.join(sorted(first))}): set data.prompt_key"
        )
    needs = _needed_columns(cfg, reward_functions)
    if cfg.answer_key and "answer" in needs and cfg.answer_key not in first:
        raise ValueError(
            f"data.answer_key={cfg.answer_key!r} is not a column of {name} "
            f"(columns: {', '.join(sorted(first))}): set data.answer_key or data.answer_key=''"
        )
    counts = {}
    kinds = _PromptKinds(cfg, tokenizer, tools)
    train = _tokenize(train_rows, cfg, tokenizer, counts, "train", needs, kinds)
    evals = _tokenize(eval_rows, cfg, tokenizer, counts, "eval", needs, kinds)
    if not train:
        # The count covers both splits: a held-out eval split comes from the same file.
        dropped_eval = counts["data/eval_dropped_too_long"]
        if dropped_eval == len(eval_rows):
            files = f"{name} and {cfg.eval}" if cfg.eval else name
            what = f"all {len(train_rows) + len(eval_rows)} prompts of {files}" + (
                " (train and eval)" if eval_rows else ""
            )
        else:
            what = (
                f"all {len(train_rows)} train prompts of {name} ({dropped_eval} of the {len(eval_rows)} "
                "eval prompts too)"
            )
        raise ValueError(
            f"{what} are longer than data.max_prompt_tokens={cfg.max_prompt_tokens}: raise it or set "
            "data.overlong=truncate"
        )
    return train, evals, counts


def _needed_columns(cfg, reward_functions) -> dict[str, str]:
    """{kwarg name: 'what needs it'} for the columns every row must hold (see load_prompts)."""
    if reward_functions is None:
        return {"answer": "data.answer_key"} if cfg.answer_key else {}
    needs = {
        col: "reward function " + ", ".join(repr(f) for f in fns)
        for col, fns in required_columns(reward_functions).items()
    }
    if "answer" in needs and not cfg.answer_key:
        raise ValueError(
            f"{needs['answer']} needs the answer column but data.answer_key is empty: "
            "set data.answer_key to the column that holds the answers"
        )
    return needs


def _template_missing(cfg, tokenizer) -> str | None:
    """Why no chat template applies (None: the tokenizer's template renders the prompts)."""
    if not cfg.chat_template:
        return "data.chat_template=false"
    if not getattr(tokenizer, "chat_template", None):
        where = getattr(tokenizer, "name_or_path", "") or "its directory"
        return f"the tokenizer of actor.model ({where}) has no chat template"
    return None


class _PromptKinds:
    """One kind of prompt per dataset (train and eval files together): the first row's decides."""

    def __init__(self, cfg, tokenizer, tools: list[dict] | None = None):
        self.cfg, self.first, self.tools = cfg, None, tools
        self.no_template = _template_missing(cfg, tokenizer)
        if tools and self.no_template:
            raise ValueError(
                f"rollout.tools is set but {self.no_template}: the tools are described to the model by the chat "
                "template (set data.chat_template=true with a tokenizer whose template renders tools=)"
            )
        if tools:  # a template that ignores tools= would train a model that was never told about them
            probe = tokenizer.apply_chat_template(
                [{"role": "user", "content": "?"}], tools=tools, tokenize=False, add_generation_prompt=True
            )
            unseen = [t["function"]["name"] for t in tools if t["function"]["name"] not in probe]
            if unseen:
                raise ValueError(
                    f"rollout.tools: the tokenizer's chat template does not render tools= (no {unseen[0]!r} in "
                    "its output): use a model whose template describes tools (e.g. Qwen2.5/Qwen3 instruct)"
                )
        if cfg.system_prompt and self.no_template:
            raise ValueError(
                f"data.system_prompt is set but {self.no_template}: a system turn needs a chat template "
                "(set data.chat_template=true with a tokenizer that has one, or unset data.system_prompt)"
            )

    def conversation(self, where: str, value) -> list[dict] | None:
        """The messages the chat template renders for this row, or None (the text goes in as it is)."""
        kind = prompt_kind(where, value, self.cfg.prompt_key)
        if self.first is None:
            self.first = (kind, where)
        elif kind != self.first[0]:
            first_kind, first_where = self.first
            raise ValueError(
                f"{where} has a {_KIND_NAMES[kind]} prompt but {first_where} has a "
                f"{_KIND_NAMES[first_kind]} one: a dataset's prompts (train and eval) are all strings or "
                "all message lists; convert the rows to one kind"
            )
        if kind == "chat":
            if self.no_template:
                raise ValueError(
                    f"{where} has a list of chat messages as its prompt but {self.no_template}: add a "
                    "chat template to the tokenizer (tokenizer_config.json's chat_template or "
                    "chat_template.jinja) and set data.chat_template=true, or give string prompts"
                )
            if self.cfg.system_prompt:
                raise ValueError(
                    f"data.system_prompt is set but {where}'s prompt is a message list: data.system_prompt "
                    "applies to string prompts; put the system turn into the rows' messages or unset it"
                )
            return [{"role": m["role"], "content": m["content"]} for m in value]
        if not value.strip():
            raise ValueError(f"{where} has an empty prompt: remove it or fill it")
        if self.no_template:
            return None
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return system + [{"role": "user", "content": value}]


_KIND_NAMES = {"text": "string", "chat": "message-list"}


def _tokenize(rows, cfg, tokenizer, counts, split, needs, kinds: _PromptKinds) -> list[Prompt]:
    out, dropped, truncated = [], 0, 0
    for i, (where, row) in enumerate(rows):
        if cfg.prompt_key not in row:
            raise ValueError(f"{where} lacks the column {cfg.prompt_key!r} (data.prompt_key)")
        for kwarg, who in needs.items():
            column = cfg.answer_key if kwarg == "answer" else kwarg
            if column not in row:
                raise ValueError(
                    f"{where} lacks the column {column!r} that {who} needs: add it or remove the row"
                    + (", or set data.answer_key='' if no reward function needs it" if who == "data.answer_key" else "")
                )
        raw = row[cfg.prompt_key]
        messages = kinds.conversation(where, raw)
        # The template's text tokenized without special tokens: apply_chat_template(messages,
        # add_generation_prompt=True) does exactly this (the template writes BOS itself).
        text = (
            tokenizer.apply_chat_template(messages, tools=kinds.tools, tokenize=False, add_generation_prompt=True)
            if messages is not None
            else raw
        )
        ids = tokenizer(text, add_special_tokens=messages is None)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            if cfg.overlong == "drop":
                dropped += 1
                continue
            ids = ids[-cfg.max_prompt_tokens :]  # keep the end: the question and the generation prompt
            text = tokenizer.decode(ids)
            truncated += 1
        columns = {k: v for k, v in row.items() if k != cfg.prompt_key}
        if cfg.answer_key:
            columns["answer"] = row.get(cfg.answer_key)
        out.append(
            Prompt(index=i, text=text, token_ids=list(ids), columns=columns, source=where, raw=raw, messages=messages)
        )
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
            raise ValueError(
                f"its data-loader position {state['position']}{then} is past the end of the "
                f"{len(self.prompts)} train prompts loaded now: resume with the data it was trained on, "
                "or start fresh with checkpoint.resume=none"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
