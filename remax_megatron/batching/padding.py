"""Right-padding: a step's (prompt, completion) rows as one padded batch for the loss.

    batch = pad_sequences(prompts_per_row, completions_per_row, pad_id, pad_to_multiple=tp)

Each row is laid out right-padded, as the megatron actor reads it (positions start at 0), with
next-token labels:

    position t:      0    1    2    3    4    5    6
    input_ids:       p0   p1   p2   r0   r1   r2   pad
    labels:          -100 -100 r0   r1   r2   -100 -100
    response_mask:   0    0    1    1    1    0    0
    engine_logprobs: 0    0    l0   l1   l2   0    0

so `PolicyModel.token_logprobs(hidden, labels)[b, t]` is the log-prob of the token at t + 1, and
response_mask / engine_logprobs line up with it. ("Packing", several sequences in one row, is
batching.micro_batches'.)
"""

from __future__ import annotations

import torch

from remax_megatron.kernels import IGNORE_INDEX
from remax_megatron.models.gpt import sequence_multiple
from remax_megatron.sizes import round_up


def pad_sequences(
    prompt_ids: list[list[int]],
    completions: list,
    pad_id: int,
    pad_to_multiple: int = 1,
    routes: bool = False,
    mask_truncated: bool = False,
) -> dict[str, torch.Tensor]:
    """Rows of prompt + response, right-padded, with labels and masks for the loss.

    prompt_ids:  B prompts (one per row; repeat a prompt for each of its completions)
    completions: B `Completion`s (token_ids, logprobs; loss_mask: a multi-turn trajectory's tokens that were
                 not generated, its observations, get label -100 and so no log-prob, loss or count)
    pad_to_multiple: round S up to a multiple of this (e.g. TP for sequence parallel)
    routes:      rollout.routing_replay: every completion carries the engine's routed experts (refused
                 in one line when one does not), and the batch holds them; False: the batch holds none
    mask_truncated: trainer.mask_truncated: a completion cut at the length limit (finish_reason "length")
                 gets no response token in response_mask (it leaves the loss and its counts; labels stay)

    Returns (all on CPU):
        input_ids       [B, S] long, right-padded with pad_id
        labels          [B, S] long, next-token targets; -100 on prompt and padding
        response_mask   [B, S] bool, labels != -100 (and not truncated, with mask_truncated)
        engine_logprobs [B, S] float32, the engine's log-prob of labels[b, t]; 0 elsewhere
        lengths         [B] long, prompt + response tokens
        prompt_lengths  [B] long
        response_lengths [B] long
        routed_experts  [B, S, layers, top_k] long, only with `routes`: the experts of each input token, -1
                        where none was given (the final token, which the engine never fed through the model,
                        and padding)
    """
    _check_rows(prompt_ids, completions, pad_to_multiple, routes)
    prompt_len = [len(p) for p in prompt_ids]
    resp_len = [len(c.token_ids) for c in completions]
    total = [p + r for p, r in zip(prompt_len, resp_len)]
    width = round_up(max(total), pad_to_multiple)
    batch = len(prompt_ids)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
    engine_logprobs = torch.zeros((batch, width), dtype=torch.float32)
    for b, (prompt, comp) in enumerate(zip(prompt_ids, completions)):
        p, r = prompt_len[b], resp_len[b]
        input_ids[b, :p] = torch.tensor(prompt, dtype=torch.long)
        if r:
            response = torch.tensor(list(comp.token_ids), dtype=torch.long)
            input_ids[b, p : p + r] = response
            # The token at position p + i is predicted at position p + i - 1.
            labels[b, p - 1 : p - 1 + r] = response
            engine_logprobs[b, p - 1 : p - 1 + r] = torch.tensor(list(comp.logprobs), dtype=torch.float32)
            if getattr(comp, "loss_mask", None) is not None:  # observations: conditioned on, never trained
                not_generated = torch.tensor(list(comp.loss_mask), dtype=torch.bool).logical_not()
                labels[b, p - 1 : p - 1 + r][not_generated] = IGNORE_INDEX
                engine_logprobs[b, p - 1 : p - 1 + r][not_generated] = 0.0
    response_mask = labels != IGNORE_INDEX
    if mask_truncated:
        response_mask[[c.finish_reason == "length" for c in completions]] = False
    batch = dict(
        input_ids=input_ids,
        labels=labels,
        response_mask=response_mask,
        engine_logprobs=engine_logprobs,
        lengths=torch.tensor(total, dtype=torch.long),
        prompt_lengths=torch.tensor(prompt_len, dtype=torch.long),
        response_lengths=torch.tensor(resp_len, dtype=torch.long),
    )
    if routes:
        batch["routed_experts"] = pad_routes([c.routed_experts for c in completions], total, width)
    return batch


def rollout_batch(cfg, tokenizer, actor, prompts, rollouts, r_sampled, r_greedy) -> dict:
    """The samples as one right-padded batch (pad_sequences) with their rewards [B] and their
    prompt's greedy reward [B] (the baseline)."""
    n = cfg.rollout.n
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # each row's context: its prompt, or the environment's first message (rollout.env)
    rows = [r.prompt_ids or q.token_ids for q, r in zip(prompts, rollouts) for _ in range(n)]
    rows = rows, [c for r in rollouts for c in r.sampled]
    batch = pad_sequences(
        *rows,
        pad_id=pad_id,
        pad_to_multiple=sequence_multiple(actor),
        routes=cfg.rollout.routing_replay,  # the engine's experts, replayed in the update
        mask_truncated=cfg.trainer.mask_truncated,
    )  # cut samples leave the loss
    batch["rewards"] = torch.tensor(r_sampled, dtype=torch.float32)  # [B]
    batch["baseline"] = torch.tensor(r_greedy, dtype=torch.float32).repeat_interleave(n)  # [B]
    return batch


def _check_rows(prompt_ids: list[list[int]], completions: list, pad_to_multiple: int, routes: bool) -> None:
    """pad_sequences' refusals, one line each, naming the row."""
    if len(prompt_ids) != len(completions):
        raise ValueError(
            f"pad_sequences got {len(prompt_ids)} prompts for {len(completions)} completions: "
            "repeat each prompt once per completion"
        )
    if not prompt_ids:
        raise ValueError("pad_sequences got no rows")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple={pad_to_multiple!r} must be >= 1")
    for b, (p, c) in enumerate(zip(prompt_ids, completions)):
        if not p:
            raise ValueError(f"row {b} has an empty prompt: a response needs a token to condition on")
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(f"row {b}: {len(c.token_ids)} tokens but {len(c.logprobs)} log-probs")
        mask = getattr(c, "loss_mask", None)
        if mask is not None and len(mask) != len(c.token_ids):
            raise ValueError(f"row {b}: {len(c.token_ids)} tokens but a loss mask of {len(mask)}")
        if routes and getattr(c, "routed_experts", None) is None:
            raise ValueError(
                f"row {b} has no routed experts but rollout.routing_replay=true: the engine must return "
                "them (the native engine, or vLLM on CUDA); set rollout.routing_replay=false"
            )


def pad_routes(routes: list, lengths: list[int], width: int) -> torch.Tensor:
    """Per row the engine's routes [tokens, layers, top_k] (tokens: the row's first tokens; vLLM gives every
    token it fed through the model) -> [B, width, layers, top_k] long, -1 where none was given."""
    first = torch.as_tensor(routes[0])
    out = torch.full((len(routes), width, *first.shape[1:]), -1, dtype=torch.long)
    for b, (r, length) in enumerate(zip(routes, lengths)):
        r = torch.as_tensor(r, dtype=torch.long)
        if r.shape[1:] != first.shape[1:]:
            raise ValueError(f"row {b}: routes of shape {tuple(r.shape)}, other rows {tuple(first.shape)}")
        rows = min(r.shape[0], length)
        out[b, :rows] = r[:rows]
    return out
