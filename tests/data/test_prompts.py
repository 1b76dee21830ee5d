"""Prompt loading: JSONL/Parquet, columns, chat template, length filter, per-epoch shuffle, errors."""

import json

import pytest

from remax_megatron.config import DataConfig
from remax_megatron.data.prompts import PromptSampler, load_prompts
from remax_megatron.data.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_columns_template_and_split(tmp_path, tok):
    rows = [{"q": f"what is {i}?", "a": str(i), "level": i % 3} for i in range(40)]
    cfg = DataConfig(train=_jsonl(tmp_path / "d.jsonl", rows), prompt_key="q", answer_key="a", eval_size=8)
    train, evals, counts = load_prompts(cfg, tok)
    assert len(train) == 32 and len(evals) == 8
    assert not {p.text for p in train} & {p.text for p in evals}
    p = train[0]
    assert p.text.startswith("user: what is") and p.text.endswith("assistant: ")
    assert p.token_ids == tok(p.text, add_special_tokens=False)["input_ids"]
    assert p.columns["answer"] == p.columns["a"] and "level" in p.columns
    assert counts["data/train_prompts"] == 32


def test_parquet_and_no_template(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}] * 3), tmp_path / "d.parquet")
    cfg = DataConfig(train=str(tmp_path / "d.parquet"), chat_template=False, eval_size=1)
    train, evals, _ = load_prompts(cfg, tok)
    assert [p.text for p in train] == ["1+1="] * 2 and len(evals) == 1


def test_overlong_drop_and_truncate(tmp_path, tok):
    rows = [{"prompt": "x" * n, "answer": ""} for n in (5, 50, 8)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    train, _, counts = load_prompts(DataConfig(train=path, chat_template=False, max_prompt_tokens=10,
                                               eval_size=0), tok)
    assert len(train) == 2 and counts["data/train_dropped_too_long"] == 1
    train, _, counts = load_prompts(DataConfig(train=path, chat_template=False, max_prompt_tokens=10,
                                               eval_size=0, overlong="truncate"), tok)
    assert len(train) == 3 and counts["data/train_truncated"] == 1 and len(train[1].token_ids) == 10


@pytest.mark.parametrize("rows,kwargs,message", [
    ([], {}, "has no rows"),
    ([{"text": "a", "answer": "1"}], {}, "data.prompt_key='prompt' is not a column"),
    ([{"prompt": "a", "label": "1"}], {}, "data.answer_key='answer' is not a column"),
    ([{"prompt": "long" * 30, "answer": "1"}] * 3, {"max_prompt_tokens": 5}, "all 3 prompts"),
    ([{"prompt": "  ", "answer": "1"}], {}, "empty prompt"),
])
def test_bad_data_one_line_errors(tmp_path, tok, rows, kwargs, message):
    cfg = DataConfig(train=_jsonl(tmp_path / "d.jsonl", rows), chat_template=False, eval_size=0, **kwargs)
    with pytest.raises(ValueError, match=message):
        load_prompts(cfg, tok)


def test_missing_file(tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(DataConfig(train="nope.jsonl"), tok)


def test_sampler_is_deterministic_per_epoch_and_resumable(tok):
    prompts = list(range(10))
    a, b = PromptSampler(prompts, seed=3), PromptSampler(prompts, seed=3)
    first = a.next(10)
    assert sorted(first) == prompts and first == b.next(10)
    second = a.next(10)
    assert sorted(second) == prompts and second != first          # a new permutation each epoch
    c = PromptSampler(prompts, seed=3)
    c.next(13)
    state = c.state_dict()
    d = PromptSampler(prompts, seed=3)
    d.load_state_dict(state)
    assert c.next(9) == d.next(9)
    assert PromptSampler(prompts, seed=3, shuffle=False).next(4) == [0, 1, 2, 3]
