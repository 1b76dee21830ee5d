"""Prompt loading: JSONL/Parquet, columns, chat template, length filter, per-epoch shuffle, errors."""

import json

import pytest

from remax_megatron.config import DataConfig
from remax_megatron.data.prompts import PromptSampler, load_prompts
from remax_megatron.builtin.tokenizer import build_tokenizer


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


@pytest.mark.parametrize("line,kind", [("5", "number"), ('"what is 2+2?"', "string"), ("[1, 2]", "array")])
def test_rows_that_are_not_objects_are_named_by_file_and_line(tmp_path, tok, line, kind):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        load_prompts(DataConfig(train=str(path), chat_template=False, eval_size=0), tok)
    assert str(e.value).startswith(f"{path}:3 is a JSON {kind} ({line}), not an object"), str(e.value)
    assert "\n" not in str(e.value)


def test_bad_rows_are_named_by_file_and_line_in_either_split(tmp_path, tok):
    """Whether the held-out shuffle puts the bad row in train or eval, the message names its line."""
    rows = [{"prompt": f"what is {i}?", "answer": str(i)} for i in range(40)]
    for bad in range(0, 40, 3):
        broken = [dict(r, prompt="  ") if i == bad else r for i, r in enumerate(rows)]
        path = _jsonl(tmp_path / "d.jsonl", broken)
        with pytest.raises(ValueError) as e:
            load_prompts(DataConfig(train=path, chat_template=False, eval_size=8), tok)
        assert str(e.value) == f"{path}:{bad + 1} has an empty prompt: remove it or fill it"


def test_all_dropped_count_covers_train_and_eval(tmp_path, tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "long" * 30, "answer": "1"}] * 10)
    with pytest.raises(ValueError, match=r"^all 10 prompts of .*d\.jsonl \(train and eval\) are longer than "
                                         r"data\.max_prompt_tokens=5"):
        load_prompts(DataConfig(train=path, chat_template=False, eval_size=2, max_prompt_tokens=5), tok)


def needs_level(prompts, responses, level, **_):
    """A user reward function that needs the `level` column."""
    return [float(lv) for lv in level]


def answer_optional(prompts, responses, answer=None, **_):
    return [0.0] * len(responses)


@pytest.mark.parametrize("functions,message", [
    (["exact_match"], "d.jsonl:4 lacks the column 'answer' that reward function 'exact_match' needs"),
    (["length_penalty", "numeric_match"], "lacks the column 'answer' that reward function 'numeric_match' needs"),
    (None, "d.jsonl:4 lacks the column 'answer' that data.answer_key needs"),
    (["tests.data.test_prompts:needs_level"],
     "d.jsonl:2 lacks the column 'level' that reward function 'tests.data.test_prompts:needs_level' needs"),
    (["length_penalty"], None),
    (["tests.data.test_prompts:answer_optional"], None),
])
def test_row_without_a_column_a_reward_function_needs_is_refused(tmp_path, tok, functions, message):
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "2+2=", "answer": "4"},
            {"prompt": "3+3=", "answer": "6", "level": 2}, {"prompt": "4+4=", "level": 3}]
    cfg = DataConfig(train=_jsonl(tmp_path / "d.jsonl", rows), chat_template=False, eval_size=1)
    if message is None:
        train, evals, _ = load_prompts(cfg, tok, functions)
        assert len(train) + len(evals) == 4
        return
    with pytest.raises(ValueError) as e:
        load_prompts(cfg, tok, functions)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
