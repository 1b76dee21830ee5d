"""What the reward model reads: the actor's token ids, or the text re-tokenized with the RM's tokenizer.

    inputs = RewardModelInputs(actor_tokenizer, rm_tokenizer, chat_template=cfg.data.chat_template)
    inputs.check_prompts([q.text for q in prompts], [q.messages for q in prompts])   # before training
    seqs = inputs.sequences(prompt_ids, prompt_texts, [(i, response_ids, response_text), ...], conversations)

A reward model scores what its own tokenizer and chat template make of a
conversation. When the RM's tokenizer equals the actor's (`same_tokenizer`:
vocabulary, special ids, normalisation and pre-tokenisation rules, chat template)
the actor's prompt + response ids pass straight through (the fast path).
Otherwise prompt and response go through text:

- chat template applied (data.chat_template and the RM tokenizer has one): the
  prompt's conversation (data/prompts.py `Prompt.messages`: a message-list prompt, or
  the string prompt as a user turn after data.system_prompt's system turn) and the
  decoded response as an assistant turn, rendered with the RM's template, as
  `rm_tokenizer.apply_chat_template([*messages, assistant])` would. (A prompt that
  data.overlong=truncate cut is given whole.) Without the conversation, the user
  message is recovered from the actor's templated prompt (`TemplateFrame`);
- otherwise: the prompt text as the actor saw it + the response text, tokenized
  by the RM tokenizer with its special tokens (BOS), as `rm_tokenizer(text)`.
"""

from __future__ import annotations

import json
import os

from transformers import AutoTokenizer

MARKER = "\x00remax-prompt\x00"  # stands for the user message while a template is rendered


def load_rm_tokenizer(rm_dir: str):
    """The reward model's own tokenizer; FileNotFoundError when its directory has none."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(rm_dir, n)) for n in names):
        raise FileNotFoundError(
            f"reward.model {rm_dir} has no tokenizer ({', '.join(names)}): copy the tokenizer "
            "the reward model was trained with into that directory"
        )
    return AutoTokenizer.from_pretrained(rm_dir)


def _backend_rules(tokenizer) -> str | None:
    """The fast tokenizer's full definition (model, normaliser, pre-tokeniser, post-processor) as JSON."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return json.dumps(json.loads(backend.to_str()), sort_keys=True)


def same_tokenizer(a, b, *, chat_template: bool) -> bool:
    """True when `a` and `b` give the same ids for every text (and conversation, with chat_template).

    Compared: the vocabulary (added tokens included), the special-token ids, the
    fast tokenizer's rules (normaliser, pre-tokeniser, post-processor: BOS/EOS
    insertion) and, when chat templates apply, the template source. Anything not
    known to be equal counts as different (the text path is always correct).
    """
    if a is b:
        return True
    if a.get_vocab() != b.get_vocab():
        return False
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    if any(getattr(a, k, None) != getattr(b, k, None) for k in specials):
        return False
    if sorted(a.all_special_ids) != sorted(b.all_special_ids):
        return False
    rules_a, rules_b = _backend_rules(a), _backend_rules(b)
    if rules_a is None or rules_a != rules_b:
        return False  # slow tokenizers: no rule set to compare
    return not chat_template or getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


class TemplateFrame:
    """The text a chat template puts around one user message (with the generation prompt).

    `user_message(prompt_text)` inverts the template: the actor's prompt is
    before + message + after. A prompt cut on the left (data.overlong=truncate)
    lost part of `before`; the longest tail of `before` it starts with is removed.
    """

    def __init__(self, tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": MARKER}], tokenize=False, add_generation_prompt=True
        )
        self.before, found, self.after = text.partition(MARKER)
        if not found or MARKER in self.after:
            raise ValueError(
                "the actor's chat template does not render the user message once and verbatim, so "
                "the reward model's template cannot be applied: set data.chat_template=false or give "
                "the reward model the actor's tokenizer"
            )

    def user_message(self, prompt_text: str) -> str:
        if not prompt_text.endswith(self.after):
            raise ValueError(
                f"prompt {prompt_text[-60:]!r} does not end like the actor's chat template "
                f"({self.after!r}): cannot recover the user message for the reward model's template"
            )
        body = prompt_text[: len(prompt_text) - len(self.after)]
        for k in range(len(self.before), 0, -1):
            if body.startswith(self.before[-k:]):
                return body[k:]
        return body


class RewardModelInputs:
    """Token ids for the reward model from the actor's prompt and response (see the module doc)."""

    def __init__(self, actor_tokenizer, rm_tokenizer, *, chat_template: bool):
        self.rm_tokenizer, self.actor_tokenizer = rm_tokenizer, actor_tokenizer
        self.passthrough = same_tokenizer(actor_tokenizer, rm_tokenizer, chat_template=chat_template)
        self.rm_template = bool(chat_template and getattr(rm_tokenizer, "chat_template", None))
        self.actor_template = bool(chat_template and getattr(actor_tokenizer, "chat_template", None))
        self._frame = None

    @property
    def frame(self) -> TemplateFrame | None:
        """Inverts the actor's template for prompts given without their conversation (built on first use)."""
        if self._frame is None and self.rm_template and self.actor_template and not self.passthrough:
            self._frame = TemplateFrame(self.actor_tokenizer)
        return self._frame

    def check_prompts(self, prompt_texts: list[str], conversations: list | None = None) -> None:
        """Raise ValueError (before training) when a prompt cannot be turned into the RM's input."""
        conversations = conversations or [None] * len(prompt_texts)
        for text, conversation in zip(prompt_texts, conversations):
            if conversation is None and self.frame is not None:
                self.frame.user_message(text)

    def text(self, prompt_text: str, response_text: str, conversation: list[dict] | None = None) -> tuple[str, bool]:
        """The RM's input text and whether the RM tokenizer adds its special tokens to it."""
        if not self.rm_template:
            return prompt_text + response_text, True
        if conversation is None:
            user = self.frame.user_message(prompt_text) if self.frame is not None else prompt_text
            conversation = [{"role": "user", "content": user}]
        rendered = self.rm_tokenizer.apply_chat_template(
            [*conversation, {"role": "assistant", "content": response_text}], tokenize=False
        )
        return rendered, False  # the template writes BOS itself, as prompts.py tokenizes templated text

    def sequences(
        self,
        prompt_ids: list[list[int]],
        prompt_texts: list[str],
        items: list[tuple[int, list[int], str]],
        conversations: list | None = None,
    ) -> list[list[int]]:
        """items = [(prompt i, response ids, response text)] -> the RM's token ids per item; conversations[i]:
        prompt i's messages (None: recovered from its text)."""
        if self.passthrough:
            return [prompt_ids[i] + list(ids) for i, ids, _ in items]
        out = []
        for i, _, response in items:
            text, special = self.text(prompt_texts[i], response, conversations[i] if conversations else None)
            out.append(self.rm_tokenizer(text, add_special_tokens=special)["input_ids"])
        return out
