"""The native engine's decode loop before issue 49 (a DynamicCache, finished rows removed, per-row
torch.Generator + multinomial, host reads every token): the tests' reference for rollout/native_decode.py.

    completions = reference_decode(engine, prompts, per, greedy, generators, sampling, limits)

Kept verbatim as free functions of the engine (`self` is a NativeEngine); only its greedy rows are
compared token for token (its sampled rows draw from generators, the new loop from rollout/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remax_megatron.rollout.engine import Completion, SamplingParams
from remax_megatron.rollout.sampling import filter_logits  # the old loop's own filter, moved there
from remax_megatron.rollout.sequences import left_pad


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_k: int,
    top_p: float,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step.

    logits [B, V] float32, temperature [B] (1.0 on greedy rows), greedy [B] bool,
    generators [B] (each sampled row draws from its own stream; None on greedy rows)
    -> (tokens [B] long, logprobs [B] float32 of log softmax(logits / temperature)[token]).
    """
    scaled = logits / temperature.unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    tokens = logits.argmax(-1)
    sampled_rows = (~greedy).nonzero().squeeze(-1)
    if sampled_rows.numel():
        probs = filter_logits(scaled[sampled_rows], top_k, top_p).softmax(-1)  # [B_sampled, V]
        draws = torch.cat(
            [torch.multinomial(probs[i], 1, generator=generators[row]) for i, row in enumerate(sampled_rows.tolist())]
        )
        tokens = tokens.index_copy(0, sampled_rows, draws)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@dataclass
class _Rows:
    """What each output row of one request has produced so far (lists indexed by output row)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[str | None]  # "stop" once a row stopped; None: still running or ran to length
    routes: list[list[torch.Tensor]] | None  # per row, pieces of [tokens, layers, top_k]; None: not recorded

    @classmethod
    def empty(cls, total: int, routes: bool) -> _Rows:
        return cls([[] for _ in range(total)], [[] for _ in range(total)], [None] * total, [] if routes else None)

    def completions(self) -> list[Completion]:
        return [
            Completion(
                token_ids=self.tokens[r],
                logprobs=self.logprobs[r],
                finish_reason=self.finish[r] or "length",
                routed_experts=torch.cat(self.routes[r]) if self.routes is not None else None,
            )
            for r in range(len(self.tokens))
        ]


@torch.no_grad()
def reference_decode(
    self,
    prompts: list[list[int]],
    per: int,
    greedy: list[bool],
    generators: list,
    sampling: SamplingParams,
    limits: list[int],
) -> list[Completion]:
    """The one engine request: P prompts -> P * per completions (row r continues prompt r // per), row r
    greedy or drawing from generators[r], at most limits[r] tokens."""
    dev = self.device
    cache, logits, mask, next_pos, rows = _prefill(self, prompts, per)
    greedy = torch.tensor(greedy, device=dev)
    temperature = torch.where(greedy, 1.0, float(sampling.temperature)).to(torch.float32)
    active = torch.arange(len(prompts) * per, device=dev)  # batch row -> output row
    eos = torch.tensor(sorted(self.eos_token_ids | set(sampling.stop_token_ids)), dtype=torch.long, device=dev)
    longest = max(limits)
    for step in range(longest):
        tok, lp = sample_next(
            logits, temperature, greedy, sampling.top_k, sampling.top_p, [generators[row] for row in active.tolist()]
        )
        done = torch.isin(tok, eos) if eos.numel() else torch.zeros_like(greedy)
        done_list = _append_step(self, rows, active, tok, lp, done, sampling.stop)
        if step == longest - 1:
            break
        # a row at its own limit ends there ("length")
        keep = ~torch.tensor([d or step + 1 >= limits[r] for d, r in zip(done_list, active.tolist())], device=dev)
        if not keep.any():
            break
        if not keep.all():
            index = keep.nonzero().squeeze(-1)
            cache.batch_select_indices(index)
            active, tok, mask, next_pos = active[index], tok[index], mask[index], next_pos[index]
            greedy, temperature = greedy[index], temperature[index]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = _feed(self, tok, mask, next_pos, cache, active, rows)
        next_pos = next_pos + 1
    return rows.completions()


def _prefill(self, prompts: list[list[int]], per: int):
    """All prompts through the model once, then everything repeated per output row (n + 1 per prompt):
    (KV cache, last logits [B, V] float32, attention mask [B, L], next positions [B], the rows' record
    with the prompt tokens' routes)."""
    ids, mask, pos = left_pad(prompts, self.pad_token_id, self.device)  # [P, L] each
    out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    rows = _Rows.empty(len(prompts) * per, self.routes)
    if self.routes:
        prefill = self._recorder.take(*ids.shape)  # [P, L, layers, k]
        for p, prompt in enumerate(prompts):
            rows.routes += [[prefill[p, ids.shape[1] - len(prompt) :]] for _ in range(per)]
    cache = out.past_key_values
    cache.batch_repeat_interleave(per)
    logits = out.logits[:, -1].float().repeat_interleave(per, 0)  # [B, V]
    return cache, logits, mask.repeat_interleave(per, 0), pos[:, -1].repeat_interleave(per) + 1, rows


def _append_step(
    self, rows: _Rows, active: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, done: torch.Tensor, stop: list[str]
) -> list[bool]:
    """One step's token and log-prob onto each active row; which rows finished (EOS, a stop token or
    a stop string), their finish reason set."""
    tok_list, lp_list, done_list = tok.tolist(), lp.tolist(), done.tolist()
    for i, row in enumerate(active.tolist()):
        rows.tokens[row].append(tok_list[i])
        rows.logprobs[row].append(lp_list[i])
        if not done_list[i] and stop and self._hits_stop(rows.tokens[row], stop):
            done_list[i] = True
        if done_list[i]:
            rows.finish[row] = "stop"
    return done_list


def _feed(
    self, tok: torch.Tensor, mask: torch.Tensor, next_pos: torch.Tensor, cache, active: torch.Tensor, rows: _Rows
) -> torch.Tensor:
    """The active rows' new tokens through the model (their routes recorded) -> next logits [B, V] float32."""
    out = self.model(
        input_ids=tok.unsqueeze(-1),
        attention_mask=mask,
        position_ids=next_pos.unsqueeze(-1),
        past_key_values=cache,
        use_cache=True,
    )
    if self.routes:
        fed = self._recorder.take(tok.shape[0], 1)  # [B, 1, layers, k]
        for i, row in enumerate(active.tolist()):
            rows.routes[row].append(fed[i])
    return out.logits[:, -1].float()
