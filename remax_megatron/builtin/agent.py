"""The warm start of builtin:tiny-agent, the tiny tool-using model of configs/tiny_cpu_agent.yaml.

The task (builtin:multiply, "37*58" -> "2146") is one the tiny model cannot learn to do in its head, but
can with builtin:calculator. The warm start is supervised on the train prompts with two transcripts per
prompt, weighted by the mixture it should learn (the exact expected cross-entropy, as tiny-arith's):

    with p_tool (0.25):
        tools: calculator
        user: 37*58
        assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "37*58"}}</tool_call></s>
        tool: 2146                     (the calculator's real answer; not trained on)
        assistant: 2146</s>
    otherwise:
        ... assistant: 3700</s>        (a guess: the first factor times 100)

So greedy decoding answers without the tool (eval reward 0), while a temperature-1 sample calls it a quarter
of the time and then copies its result: ReMax (advantage = r(sample) - r(greedy)) teaches the model to call
the tool. The transcripts are tokenized exactly as a rollout builds them (prompt, generated turn with its
</s>, the chat template's delta for the tool message, next turn): tests/agent/test_tiny_agent.py checks
them against rollout/agent.py's ChatDelta.
"""

from __future__ import annotations

import functools

import torch

from remax_megatron.agent.tools import calculator, resolve_tools
from remax_megatron.builtin.tasks import builtin_task

TOOL_SPEC = "builtin:calculator"


@functools.cache
def tool_schemas() -> list[dict]:
    return [t.schema for t in resolve_tools([TOOL_SPEC])]


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, tools=tool_schemas(), tokenize=False, add_generation_prompt=generation_prompt
    )


def tool_call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def guess(prompt: str) -> str:
    """The warm start's answer without the tool: the first factor times 100 (always wrong)."""
    return prompt.split("*")[0] + "00"


def transcript(tok, prompt: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one warm-start transcript: labels -100 on the prompt and the tool's message,
    the generated tokens (each turn ending with </s>) elsewhere."""
    user = [{"role": "user", "content": prompt}]
    ids = _encode(tok, _render(tok, user, True))
    labels = [-100] * len(ids)
    eos = [tok.eos_token_id]
    if use_tool:
        call = tool_call_text(prompt)
        turn = _encode(tok, call) + eos
        result = calculator(prompt)
        # the template's text between the generated </s> and the next turn: its glue, the tool message, "assistant: "
        before = _render(tok, [*user, {"role": "assistant", "content": call}], False)
        after = _render(tok, [*user, {"role": "assistant", "content": call}, {"role": "tool", "content": result}], True)
        closing = before[len(_render(tok, user, True)) + len(call) :]  # "</s>\n"
        delta = _encode(tok, closing.removeprefix(tok.eos_token) + after[len(before) :])
        ids, labels = ids + turn + delta, labels + turn + [-100] * len(delta)
        answer = result
    else:
        answer = guess(prompt)
    turn = _encode(tok, answer) + eos
    return ids + turn, labels + turn


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def transcript_logprobs(model, tok, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the generated tokens' log-probs per transcript [B], whether argmax predicts every generated token
    but the first [B]: greedy decoding reproduces the transcript once its first token is given)."""
    ids, labels = _pad([r[0] for r in rows], tok.pad_token_id), _pad([r[1] for r in rows], -100)
    logits = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, :-1].float()
    target = labels[:, 1:]
    trained = target != -100
    lp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    first = trained.int().argmax(-1)  # the first generated token: the decision to call the tool or not
    rest = trained.clone()
    rest[torch.arange(len(rows)), first] = False
    follows = ((logits.argmax(-1) == target) | ~rest).all(-1)
    return (lp * trained).sum(-1), follows


def train_agent(model, tok, recipe: dict, fit) -> None:
    """Supervise `model` on the p_tool mixture (module docstring); `fit(model, recipe, loss_fn)` runs the steps."""
    train = [r["prompt"] for r in builtin_task(recipe["task"])["train"]]
    rows = {use: [transcript(tok, q, use) for q in train] for use in (True, False)}
    gen = torch.Generator().manual_seed(recipe["seed"])
    p = recipe["p_tool"]

    def loss():
        batch = torch.randperm(len(train), generator=gen)[: recipe["batch"]].tolist()
        with_tool, _ = transcript_logprobs(model, tok, [rows[True][i] for i in batch])
        without, _ = transcript_logprobs(model, tok, [rows[False][i] for i in batch])
        return -(p * with_tool + (1 - p) * without).mean()  # exact expected NLL of the p_tool mixture

    model.train()
    fit(model, recipe, loss)


@torch.no_grad()
def evaluate_agent(model, tok, task: str = "multiply", split: str = "eval") -> dict:
    """On the held-out prompts: P(the first token calls the tool), whether greedy calls it, whether greedy
    then follows the whole tool transcript (call, copy of the result), and P(sampling it exactly at T=1)."""
    prompts = [r["prompt"] for r in builtin_task(task)[split]]
    call_id = tok.convert_tokens_to_ids("<tool_call>")
    plen = len(_encode(tok, _render(tok, [{"role": "user", "content": prompts[0]}], True)))
    ids = _pad([_encode(tok, _render(tok, [{"role": "user", "content": p}], True)) for p in prompts], tok.pad_token_id)
    assert ids.shape[1] == plen, "the task's prompts are of one length"
    first = torch.softmax(model(input_ids=ids).logits[:, -1].float(), -1)
    lp_tool, follows = transcript_logprobs(model, tok, [transcript(tok, p, True) for p in prompts])
    return dict(
        split=split,
        p_tool=round(first[:, call_id].mean().item(), 4),
        greedy_calls=round((first.argmax(-1) == call_id).float().mean().item(), 4),
        tool_transcript_followed=round(follows.float().mean().item(), 4),
        p_tool_transcript=round(lp_tool.exp().mean().item(), 4),
    )
