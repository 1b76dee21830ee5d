"""When the reward model gets the actor's ids and when text re-tokenized with its own tokenizer."""

import copy

import pytest

from remax_megatron.builtin.tokenizer import build_tokenizer
from remax_megatron.reward.rm_inputs import RewardModelInputs, TemplateFrame, same_tokenizer
from tests.reward.test_scoring import other_tokenizer


def test_identical_tokenizers_keep_the_fast_path(tmp_path):
    from transformers import AutoTokenizer

    actor = build_tokenizer()
    actor.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)  # another object, same tokenizer
    assert same_tokenizer(actor, reloaded, chat_template=True)
    inputs = RewardModelInputs(actor, reloaded, chat_template=True)
    assert inputs.passthrough
    assert inputs.sequences([[7, 8]], ["p"], [(0, [9, 2], "x")]) == [[7, 8, 9, 2]]


def test_differences_leave_the_fast_path():
    actor = build_tokenizer()
    assert not same_tokenizer(actor, other_tokenizer(), chat_template=False)  # other ids
    assert not same_tokenizer(actor, build_tokenizer(120), chat_template=False)  # more tokens
    templ = copy.deepcopy(actor)
    templ.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not same_tokenizer(actor, templ, chat_template=True)
    assert same_tokenizer(actor, templ, chat_template=False)  # templates unused: same ids
    eos = copy.deepcopy(actor)
    eos.pad_token = "</s>"
    assert not same_tokenizer(actor, eos, chat_template=False)
    rules = copy.deepcopy(actor)
    from tokenizers import normalizers

    rules.backend_tokenizer.normalizer = normalizers.Lowercase()  # same vocab, other ids for "A"
    assert rules("A")["input_ids"] != actor("A")["input_ids"]
    assert not same_tokenizer(actor, rules, chat_template=False)


def test_template_frame_recovers_the_user_message():
    actor = build_tokenizer()
    frame = TemplateFrame(actor)
    text = actor.apply_chat_template(
        [{"role": "user", "content": "2+3= ?"}], tokenize=False, add_generation_prompt=True
    )
    assert frame.user_message(text) == "2+3= ?"
    assert frame.user_message(text[3:]) == "2+3= ?"  # cut on the left (data.overlong=truncate)
    with pytest.raises(ValueError, match="does not end like the actor's chat template"):
        frame.user_message("2+3=")
    inputs = RewardModelInputs(actor, other_tokenizer(), chat_template=True)
    with pytest.raises(ValueError, match="cannot recover the user message"):
        inputs.check_prompts([text, "raw prompt"])
    assert inputs.text(text, "5") == ("<s>[user]2+3= ?[assistant]5</s>", False)


def test_template_that_drops_the_message_is_refused_where_the_conversation_is_unknown():
    """The actor's template is inverted only for a prompt given without its conversation (the trainer's
    prompts carry theirs, data/prompts.py Prompt.messages)."""
    actor = build_tokenizer()
    actor.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    inputs = RewardModelInputs(actor, other_tokenizer(), chat_template=True)
    inputs.check_prompts(["2+3= ?"], [[{"role": "user", "content": "2+3= ?"}]])
    with pytest.raises(ValueError, match="data.chat_template=false"):
        inputs.check_prompts(["2+3= ?"])


def test_the_rm_reads_the_whole_conversation_of_a_chat_prompt():
    """A message-list prompt (system turn included) reaches the RM's template as the same conversation
    plus the response as the assistant turn: what rm_tokenizer.apply_chat_template would make of it."""
    actor, rm = build_tokenizer(), other_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3= ?"},
        {"role": "assistant", "content": "Let me see."},
        {"role": "user", "content": "Well?"},
    ]
    text = actor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = RewardModelInputs(actor, rm, chat_template=True)
    [ids] = inputs.sequences(
        [actor(text, add_special_tokens=False)["input_ids"]], [text], [(0, actor("5")["input_ids"], "5")], [messages]
    )
    expected = rm.apply_chat_template([*messages, {"role": "assistant", "content": "5"}])["input_ids"]
    assert ids == expected, rm.decode(ids)


def _bos_adding(tokenizer):
    """The tokenizer with a post-processor that puts BOS first (as Llama's does)."""
    from tokenizers import processors

    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert tokenizer("ab")["input_ids"][0] == bos
    return tokenizer


@pytest.mark.parametrize("chat_template", [False, True])
def test_the_rm_gets_its_special_tokens_exactly_once(chat_template):
    """Re-tokenized text carries the RM's BOS once: added by its tokenizer on the plain path, written
    by its template on the chat path (where adding it again would double it)."""
    actor, rm = build_tokenizer(), _bos_adding(other_tokenizer())
    inputs = RewardModelInputs(actor, rm, chat_template=chat_template)
    assert not inputs.passthrough
    prompt = (
        actor.apply_chat_template([{"role": "user", "content": "2+3= ?"}], tokenize=False, add_generation_prompt=True)
        if chat_template
        else "2+3= ?"
    )
    [ids] = inputs.sequences([actor(prompt)["input_ids"]], [prompt], [(0, actor("5")["input_ids"], "5")])
    body = "[user]2+3= ?[assistant]5</s>" if chat_template else "2+3= ?5"
    # the reference: the RM's ids of the text without any special token added, BOS in front by hand
    assert ids == [rm.bos_token_id] + rm(body, add_special_tokens=False)["input_ids"], rm.convert_ids_to_tokens(ids)
