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
    train, _, counts = load_prompts(DataConfig(train=path, chat_template=False, max_prompt_tokens=10, eval_size=0), tok)
    assert len(train) == 2 and counts["data/train_dropped_too_long"] == 1
    train, _, counts = load_prompts(
        DataConfig(train=path, chat_template=False, max_prompt_tokens=10, eval_size=0, overlong="truncate"), tok
    )
    assert len(train) == 3 and counts["data/train_truncated"] == 1 and len(train[1].token_ids) == 10


@pytest.mark.parametrize(
    "rows,kwargs,message",
    [
        ([], {}, "has no rows"),
        ([{"text": "a", "answer": "1"}], {}, "data.prompt_key='prompt' is not a column"),
        ([{"prompt": "a", "label": "1"}], {}, "data.answer_key='answer' is not a column"),
        ([{"prompt": "long" * 30, "answer": "1"}] * 3, {"max_prompt_tokens": 5}, "all 3 prompts"),
        ([{"prompt": "  ", "answer": "1"}], {}, "empty prompt"),
    ],
)
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
    assert sorted(second) == prompts and second != first  # a new permutation each epoch
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
    with pytest.raises(
        ValueError,
        match=r"^all 10 prompts of .*d\.jsonl \(train and eval\) are longer than "
        r"data\.max_prompt_tokens=5",
    ):
        load_prompts(DataConfig(train=path, chat_template=False, eval_size=2, max_prompt_tokens=5), tok)


def needs_level(prompts, responses, level, **_):
    """A user reward function that needs the `level` column."""
    return [float(lv) for lv in level]


def answer_optional(prompts, responses, answer=None, **_):
    return [0.0] * len(responses)


@pytest.mark.parametrize(
    "functions,message",
    [
        (["exact_match"], "d.jsonl:4 lacks the column 'answer' that reward function 'exact_match' needs"),
        (["length_penalty", "numeric_match"], "lacks the column 'answer' that reward function 'numeric_match' needs"),
        (None, "d.jsonl:4 lacks the column 'answer' that data.answer_key needs"),
        (
            ["tests.data.test_prompts:needs_level"],
            "d.jsonl:2 lacks the column 'level' that reward function 'tests.data.test_prompts:needs_level' needs",
        ),
        (["length_penalty"], None),
        (["tests.data.test_prompts:answer_optional"], None),
    ],
)
def test_row_without_a_column_a_reward_function_needs_is_refused(tmp_path, tok, functions, message):
    rows = [
        {"prompt": "1+1=", "answer": "2", "level": 1},
        {"prompt": "2+2=", "answer": "4"},
        {"prompt": "3+3=", "answer": "6", "level": 2},
        {"prompt": "4+4=", "level": 3},
    ]
    cfg = DataConfig(train=_jsonl(tmp_path / "d.jsonl", rows), chat_template=False, eval_size=1)
    if message is None:
        train, evals, _ = load_prompts(cfg, tok, functions)
        assert len(train) + len(evals) == 4
        return
    with pytest.raises(ValueError) as e:
        load_prompts(cfg, tok, functions)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- chat data: message-list prompts, data.system_prompt, prompts of other types ---------------------------------

# The non-tool branch of Qwen2.5-Instruct's chat template (ChatML; a default system turn when the conversation
# has none): a real Jinja template with control flow, loop variables and special tokens.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen_tok():
    """The character tokenizer with ChatML's special tokens and Qwen2.5's template."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN_TEMPLATE
    return tok


CONVERSATIONS = [
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+3?"}],
    [{"role": "user", "content": "What is 7*6?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "1+1?"},
    ],
]


@pytest.mark.parametrize("prompt_key", ["messages", "prompt"])  # a messages column; TRL's conversational prompt
def test_message_list_prompts_are_exactly_the_tokenizers_chat_template(tmp_path, qwen_tok, prompt_key):
    rows = [{prompt_key: m, "answer": str(i)} for i, m in enumerate(CONVERSATIONS)]
    cfg = DataConfig(train=_jsonl(tmp_path / "chat.jsonl", rows), prompt_key=prompt_key, eval_size=0)
    train, _, _ = load_prompts(cfg, qwen_tok)
    for p, messages in zip(train, CONVERSATIONS):
        assert p.token_ids == qwen_tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert p.text == qwen_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert p.raw == messages and p.messages == messages and p.is_chat
        assert prompt_key not in p.columns and p.columns["answer"] is not None
    assert "[{'role'" not in train[0].text and "<|im_start|>system\nAnswer with a number." in train[0].text


def test_message_list_prompts_from_parquet(tmp_path, qwen_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": m, "answer": "1"} for m in CONVERSATIONS]), tmp_path / "c.parquet")
    train, _, _ = load_prompts(DataConfig(train=str(tmp_path / "c.parquet"), eval_size=0), qwen_tok)
    assert [p.token_ids for p in train] == [
        qwen_tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in CONVERSATIONS
    ]


def test_system_prompt_comes_before_every_string_prompt(tmp_path, qwen_tok):
    cfg = DataConfig(
        train=_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2+3?", "answer": "5"}]),
        eval_size=0,
        system_prompt="Answer with a number.",
    )
    (p,), _, _ = load_prompts(cfg, qwen_tok)
    assert p.messages == CONVERSATIONS[0] and p.raw == "What is 2+3?" and not p.is_chat
    assert p.token_ids == qwen_tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)["input_ids"]


def _refusal(tmp_path, tok, lines: list[str], name="d.jsonl", **kwargs) -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError) as e:
        load_prompts(DataConfig(train=str(path), eval_size=0, **kwargs), tok)
    assert "\n" not in str(e.value)
    return str(e.value).replace(str(path), name)


CHAT_ROW = json.dumps({"prompt": CONVERSATIONS[1], "answer": "42"})
TEXT_ROW = json.dumps({"prompt": "What is 7*6?", "answer": "42"})


def test_message_lists_need_a_chat_template(tmp_path, qwen_tok):
    line = _refusal(tmp_path, qwen_tok, [CHAT_ROW, CHAT_ROW], chat_template=False)
    assert line.startswith("d.jsonl:1 has a list of chat messages as its prompt but data.chat_template=false"), line
    no_template = build_tokenizer()
    no_template.chat_template = None
    line = _refusal(tmp_path, no_template, [CHAT_ROW])
    assert line.startswith("d.jsonl:1 has a list of chat messages as its prompt but the tokenizer of actor.model"), line
    assert "has no chat template: add a chat template to the tokenizer" in line


def test_rows_mixing_strings_and_message_lists_are_refused(tmp_path, qwen_tok):
    line = _refusal(tmp_path, qwen_tok, [CHAT_ROW, CHAT_ROW, TEXT_ROW])
    assert line.startswith("d.jsonl:3 has a string prompt but d.jsonl:1 has a message-list one: a dataset's prompts"), (
        line
    )
    line = _refusal(tmp_path, qwen_tok, [TEXT_ROW, CHAT_ROW])
    assert line.startswith("d.jsonl:2 has a message-list prompt but d.jsonl:1 has a string one"), line


@pytest.mark.parametrize(
    "value,shown",
    [
        (None, "a null (null)"),
        (5, "a number (5)"),
        (2.5, "a number (2.5)"),
        (True, "a boolean (true)"),
        ({"role": "user", "content": "hi"}, 'an object ({"role": "user", "content": "hi"})'),
    ],
)
def test_prompts_that_are_neither_text_nor_messages_are_refused_by_row(tmp_path, qwen_tok, value, shown):
    line = _refusal(tmp_path, qwen_tok, [TEXT_ROW, json.dumps({"prompt": value, "answer": "1"})])
    kind = shown.split(" (")[0].split(" ", 1)[1]
    assert line.startswith(f"d.jsonl:2: the prompt is a {kind} ("), line
    assert "must hold a string or a list of" in line


def test_a_null_prompt_in_parquet_is_refused_by_row(tmp_path, tok):
    """Issue 31 (3): a Parquet null trained on the literal 'None'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}, {"prompt": None, "answer": "4"}]), path)
    with pytest.raises(ValueError) as e:
        load_prompts(DataConfig(train=str(path), eval_size=0, chat_template=False), tok)
    assert str(e.value).startswith(
        f"{path} row 2: the prompt is a null (null): the prompt column 'prompt' must hold"
    ), str(e.value)


def test_malformed_messages_and_a_system_prompt_without_a_template_are_refused(tmp_path, qwen_tok):
    bad = json.dumps({"prompt": [{"role": "user", "text": "hi"}], "answer": "1"})
    line = _refusal(tmp_path, qwen_tok, [bad])
    assert line.startswith('d.jsonl:1: message 0 of the prompt is {"role": "user", "text": "hi"}, not a'), line
    line = _refusal(tmp_path, qwen_tok, [TEXT_ROW], system_prompt="Be brief.", chat_template=False)
    assert line.startswith("data.system_prompt is set but data.chat_template=false"), line
    line = _refusal(tmp_path, qwen_tok, [CHAT_ROW], system_prompt="Be brief.")
    assert "data.system_prompt applies to string prompts" in line, line
