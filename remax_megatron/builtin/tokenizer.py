"""A character-level tokenizer built locally with `tokenizers` (no downloads).

Used by tools/make_tiny_model.py and the embedded tiny tasks: one token per
printable ASCII character, plus <pad>, <s>, </s>, <unk> and optional filler
tokens up to a requested vocab size.

`build_tokenizer(tools=True)` is the tool-using variant (the built-in agent model, builtin:tiny-agent):
a few whole words as single tokens, as a real tokenizer has them (<tool_call> and </tool_call> as in
Qwen2.5 / Qwen3, the roles, the JSON keys of a hermes call), and a chat template that renders `tools=`
(their names) and ends each assistant turn with </s>:

    tools: calculator
    user: 37*58
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37*58"}}</tool_call></s>
    tool: 2146
    assistant: 2146</s>
"""

from __future__ import annotations

import string

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Whole-word tokens of the tool-using variant (added tokens, not special: decoding keeps them, so the hermes
# parser sees <tool_call> in the decoded turn). Matched longest first: "tools" is one token, not "tool" + "s".
TOOL_WORDS = ["<tool_call>", "</tool_call>", "tools", "tool", "user", "assistant", "system"]
TOOL_WORDS += ["name", "arguments", "calculator", "expression"]
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}{{ t['function']['name'] }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer(vocab_size: int | None = None, tools: bool = False):
    """A transformers PreTrainedTokenizerFast over printable ASCII characters (tools: the tool-using variant)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    tokens = SPECIAL + chars
    words = TOOL_WORDS if tools else []
    if vocab_size is not None:
        if vocab_size < len(tokens) + len(words):
            raise ValueError(
                f"--vocab {vocab_size} is too small: the character tokenizer needs >= {len(tokens) + len(words)}"
            )
        tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens) - len(words))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.add_tokens([AddedToken(w, normalized=False) for w in words])
    fast.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return fast
