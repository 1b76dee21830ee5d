"""Prompt datasets: JSONL / Parquet / built-in tasks -> tokenized prompts, split, shuffled per epoch.

    train, eval, counts = load_prompts(cfg.data, tokenizer, seed)
    sampler = PromptSampler(train, seed)           # deterministic per-epoch order
    batch = sampler.next(8)                        # list[Prompt]; sampler.state_dict() for resume
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field


@dataclass
class Prompt:
    index: int                 # position in its split (names the prompt in errors)
    text: str                  # what the model sees (after the chat template)
    token_ids: list[int]
    columns: dict = field(default_factory=dict)  # the other columns (answer, ...)


def read_records(source: str) -> list[dict]:
    """Rows of a JSONL or Parquet file; `builtin:<task>` rows are handled by load_prompts."""
    if not os.path.isfile(source):
        raise FileNotFoundError(f"data file {source} not found: give a .jsonl or .parquet path or builtin:arith")
    if source.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(source).to_pylist()
    rows = []
    with open(source) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}:{line_no} is not valid JSON ({e.msg})") from None
    return rows


def _split_sources(cfg) -> tuple[list[dict], list[dict], str]:
    if cfg.train.startswith("builtin:"):
        from remax_megatron.data.builtin import builtin_task

        task = builtin_task(cfg.train.split(":", 1)[1])
        return task["train"], task["eval"], cfg.train
    train = read_records(cfg.train)
    if cfg.eval:
        return train, read_records(cfg.eval), cfg.train
    # Held-out split: a fixed slice after a seeded shuffle (independent of trainer.seed).
    order = list(range(len(train)))
    random.Random(1234).shuffle(order)
    held = set(order[: min(cfg.eval_size, max(0, len(train) - 1))])
    return ([r for i, r in enumerate(train) if i not in held],
            [r for i, r in enumerate(train) if i in held], cfg.train)


def load_prompts(cfg, tokenizer) -> tuple[list[Prompt], list[Prompt], dict]:
    """Tokenized train and eval prompts plus counts (dropped / truncated as too long)."""
    train_rows, eval_rows, name = _split_sources(cfg)
    if not train_rows:
        raise ValueError(f"data.train={name} has no rows: give a non-empty dataset")
    missing = [c for c in (cfg.prompt_key,) if c not in train_rows[0]]
    if missing:
        raise ValueError(f"data.prompt_key={cfg.prompt_key!r} is not a column of {name} "
                         f"(columns: {', '.join(sorted(train_rows[0]))}): set data.prompt_key")
    if cfg.answer_key and cfg.answer_key not in train_rows[0]:
        raise ValueError(f"data.answer_key={cfg.answer_key!r} is not a column of {name} "
                         f"(columns: {', '.join(sorted(train_rows[0]))}): set data.answer_key or data.answer_key=''")
    counts = {}
    train = _tokenize(train_rows, cfg, tokenizer, counts, "train")
    evals = _tokenize(eval_rows, cfg, tokenizer, counts, "eval")
    if not train:
        raise ValueError(f"all {len(train_rows)} prompts of {name} are longer than data.max_prompt_tokens="
                         f"{cfg.max_prompt_tokens}: raise it or set data.overlong=truncate")
    return train, evals, counts


def _tokenize(rows, cfg, tokenizer, counts, split) -> list[Prompt]:
    templated = cfg.chat_template and getattr(tokenizer, "chat_template", None)
    out, dropped, truncated = [], 0, 0
    for i, row in enumerate(rows):
        if cfg.prompt_key not in row:
            raise ValueError(f"row {i} of the {split} data lacks the column {cfg.prompt_key!r}")
        raw = str(row[cfg.prompt_key])
        if not raw.strip():
            raise ValueError(f"row {i} of the {split} data has an empty prompt: remove it or fill it")
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
        out.append(Prompt(index=i, text=text, token_ids=list(ids), columns=columns))
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
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
