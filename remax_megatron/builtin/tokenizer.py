"""A character-level tokenizer built locally with `tokenizers` (no downloads).

Used by tools/make_tiny_model.py and the embedded tiny task: one token per
printable ASCII character, plus <pad>, <s>, </s>, <unk> and optional filler
tokens up to a requested vocab size.
"""

from __future__ import annotations

import string

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer(vocab_size: int | None = None):
    """A transformers PreTrainedTokenizerFast over printable ASCII characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    tokens = SPECIAL + chars
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"--vocab {vocab_size} is too small: the character tokenizer needs >= {len(tokens)}")
        tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
