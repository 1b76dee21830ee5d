"""Score sampled and greedy responses with one reward: rule functions and/or a reward model.

The greedy response (the ReMax baseline) goes through exactly the same reward as
the samples, in the same call; a response that occurs twice for a prompt (e.g. a
sample equal to the greedy one) is scored once. With reward.workers the functions
run in worker processes, each call under reward.timeout_s (reward/workers.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from remax_megatron.batching.micro_batches import plan_micro_batches
from remax_megatron.models.forward import forward_only
from remax_megatron.models.gpt import RewardModel, sequence_multiple
from remax_megatron.parallel import all_reduce_cpu
from remax_megatron.reward.functions import RewardBatch, RewardError, RewardFunctions
from remax_megatron.reward.rm_inputs import RewardModelInputs
from remax_megatron.reward.workers import RewardWorkers
from remax_megatron.sizes import round_up


class ScoredPrompt(Protocol):
    """What the scorer reads of a prompt (data.prompts.Prompt is one; reward does not import data, which
    imports reward's functions)."""

    text: str
    token_ids: list[int]
    columns: dict
    index: int
    raw: object
    messages: list[dict] | None

    @property
    def is_chat(self) -> bool: ...


class RewardScorer:
    """reward = sum_k w_k * f_k(response) + model_weight * RM(prompt + response)."""

    def __init__(
        self,
        functions: RewardFunctions | None,
        reward_model: RewardModel | None = None,
        model_weight: float = 1.0,
        micro_batch_size: int = 8,
        rm_inputs: RewardModelInputs | None = None,
        micro_batch_tokens: int = 0,
        workers: RewardWorkers | None = None,
        mp_group=None,
    ):
        """rm_inputs maps the actor's prompt + response to the RM's token ids; None: the actor's ids as they are
        (the reward model shares the actor's tokenizer). micro_batch_tokens (trainer.micro_batch_tokens): > 0
        groups the reward model's rows under that token budget as the training forward does
        (batching.plan_micro_batches); 0: micro_batch_size rows per micro-batch, all as wide as the longest.
        workers: the functions' worker pool (reward.workers > 0; None: called in this process); mp_group: the
        ranks that score the same responses (the actor's model-parallel group), which must agree on the
        responses that timed out."""
        self.functions, self.reward_model, self.rm_inputs = functions, reward_model, rm_inputs
        self.model_weight, self.micro_batch_size = model_weight, micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.workers, self.mp_group = workers, mp_group

    def close(self) -> None:
        """Stop the worker processes (the end of a run; idempotent)."""
        if self.workers is not None:
            self.workers.close()

    def score(
        self,
        prompts: Sequence[ScoredPrompt],
        responses: list[list[tuple[list[int], str]]],
        wait: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        response_columns: list[list[dict]] | None = None,
    ) -> tuple[list[list[float]], dict]:
        """responses[i] = [(token_ids, text), ...] for prompts[i] (samples then greedy) -> rewards, same shape.

        Returns the rewards and metrics (`reward/<fn>_mean`, `reward/model_mean`, with workers
        `reward/timeouts`: responses scored reward.timeout_value, ...). `wait()` is entered once, around
        the collective where this rank waits for every other rank to finish its rollout and functions (the
        trainer times it as time/wait_s, apart from this rank's own scoring). response_columns: keywords of
        each response's own (same shape as responses), e.g. a trajectory's environment as `env`.
        """
        if self.functions is None and self.reward_model is None:  # only an environment's reward() was configured
            raise ValueError("no reward: configure reward.functions and/or reward.model")
        unique: dict[tuple, int] = {}
        items = []  # (prompt i, token ids, text)
        own: list[dict] = []  # per item: its first response's own columns
        where = []
        for i, per_prompt in enumerate(responses):
            row = []
            for j, (ids, text) in enumerate(per_prompt):
                key = (i, tuple(ids))
                if key not in unique:
                    unique[key] = len(items)
                    items.append((i, ids, text))
                    own.append(response_columns[i][j] if response_columns is not None else {})
                row.append(unique[key])
            where.append(row)
        total = [0.0] * len(items)
        metrics = {"reward/unique_scored": float(len(items))}
        error, timed_out = None, []
        if self.functions is not None:
            keys = sorted({k for q in prompts for k in q.columns})
            batch = RewardBatch(
                prompts=[prompts[i].text for i, _, _ in items],
                responses=[t for _, _, t in items],
                columns={
                    **{k: [prompts[i].columns.get(k) for i, _, _ in items] for k in keys},
                    **{k: [o.get(k) for o in own] for k in sorted({k for o in own for k in o})},
                },
                prompt_index=[prompts[i].index for i, _, _ in items],
                raw_prompts=[prompts[i].raw for i, _, _ in items],
                completion_ids=[list(ids) for _, ids, _ in items],
                chat=any(q.is_chat for q in prompts),
            )
            try:
                if self.workers is not None:
                    values, parts, timed_out = self.workers.score(batch)
                else:
                    values, parts = self.functions.score(batch)
            except RewardError as e:
                error = e
        with wait():  # every rank meets here, so the reward model's collectives below do not hide the wait
            _stop_together(error)
            if self.workers is not None:
                values, parts, timed_out = self._agree(values, parts, timed_out)
        if self.functions is not None:
            total = values
            for name, vals in parts.items():
                metrics[f"reward/{name.split(':')[-1]}_mean"] = sum(vals) / max(1, len(vals))
            if self.workers is not None:
                metrics["reward/timeouts"] = float(len(timed_out))
        if self.reward_model is not None:
            sequences = (
                self.rm_inputs.sequences(
                    [q.token_ids for q in prompts], [q.text for q in prompts], items, [q.messages for q in prompts]
                )
                if self.rm_inputs is not None
                else [prompts[i].token_ids + list(ids) for i, ids, _ in items]
            )
            scores = self._model_scores(sequences)
            total = [t + self.model_weight * s for t, s in zip(total, scores)]
            metrics["reward/model_mean"] = sum(scores) / max(1, len(scores))
        return [[total[j] for j in row] for row in where], metrics

    def _agree(self, values: list[float], parts: dict[str, list[float]], timed_out: list[int]):
        """A response that timed out on any rank of mp_group times out on all: they score the same responses,
        and a call that ends near the limit may time out on one of them only (their rewards must be equal)."""
        if self.mp_group is None or dist.get_world_size(self.mp_group) == 1:
            return values, parts, timed_out
        mask = torch.zeros(len(values), dtype=torch.int64)
        mask[timed_out] = 1
        timed_out = all_reduce_cpu(mask, op=dist.ReduceOp.MAX, group=self.mp_group).nonzero().flatten().tolist()
        out, gone = self.workers.timeout_value, set(timed_out)
        values = [out if j in gone else v for j, v in enumerate(values)]
        parts = {k: [out if j in gone else v for j, v in enumerate(vals)] for k, vals in parts.items()}
        return values, parts, timed_out

    def _fixed_batches(self, mine: list[list[int]]) -> list[dict]:
        """micro_batch_size rows per micro-batch, all as wide as the longest (rounded up to the sequence
        multiple: sequence parallel splits it); the last one filled up with filler rows."""
        model, mbs = self.reward_model, self.micro_batch_size
        padded_count = round_up(len(mine), mbs)
        width = round_up(max(len(s) for s in mine), sequence_multiple(model))
        whole = _padded_rows(model, mine, padded_count, width)
        return [
            {"input_ids": whole["input_ids"][s : s + mbs], "positions": whole["positions"][s : s + mbs]}
            for s in range(0, padded_count, mbs)
        ]

    def _budget_batches(self, mine: list[list[int]]) -> tuple[list[int], list[dict]]:
        """The rows grouped under trainer.micro_batch_tokens by the training forward's own grouping
        (batching.plan_micro_batches: longest first, each micro-batch as wide as its longest row); returns
        the rows in the order the micro-batches hold them, and the micro-batches. A row longer than the
        budget (the reward model's own tokenizer can make a longer one) runs alone."""
        model, budget = self.reward_model, self.micro_batch_tokens
        multiple = sequence_multiple(model)
        over = sorted(
            (j for j, s in enumerate(mine) if round_up(len(s), multiple) > budget), key=lambda j: (-len(mine[j]), j)
        )
        rest = sorted(set(range(len(mine))) - set(over))
        micro = [([j], round_up(len(mine[j]), multiple)) for j in over] + [
            (m.rows, m.width) for m in plan_micro_batches([len(mine[j]) for j in rest], budget, multiple, rows=rest)
        ]
        order = [j for rows, _ in micro for j in rows]
        return order, [_padded_rows(model, [mine[j] for j in rows], len(rows), width) for rows, width in micro]

    @torch.no_grad()
    def _model_scores(self, sequences: list[list[int]]) -> list[float]:
        """Reward-model score of each sequence at the token HF reads.

        Collective over the reward model's `layout.outer` group: one or more whole actor
        model-parallel groups (the ranks of one pass the same sequences). When it joins several,
        their sequences are gathered first. Each replica of the reward model there scores its
        share, and a sum over the group (one contributor per item) hands every rank all scores.
        """
        model = self.reward_model
        layout = model.layout
        first, count = 0, len(sequences)  # this rank's items within the scored list
        if layout.actor_replicas > 1:  # a reward model larger than the actor's model-parallel group
            every: list = [None] * layout.outer.size()
            dist.all_gather_object(every, (layout.actor_replica, sequences), group=layout.outer)
            per_replica = dict(every)  # the ranks of one actor replica sent the same list
            first = sum(len(per_replica[r]) for r in range(layout.actor_replica))
            sequences = [s for r in range(layout.actor_replicas) for s in per_replica[r]]
        share = layout.share(len(sequences))
        scores = torch.zeros(len(sequences), dtype=torch.float64)
        if len(share):
            mine = [sequences[i] for i in share]
            if self.micro_batch_tokens:
                order, batches = self._budget_batches(mine)
            else:
                order, batches = list(range(len(mine))), self._fixed_batches(mine)
            out = forward_only(model, batches, lambda m, values, b: m.scores(values, b["positions"]))
            if layout.is_last_stage and layout.tp_rank == 0:  # one contributor per item: the sum is exact
                got = torch.cat(out)[: len(mine)].double().cpu()
                scores[[share.start + j for j in order]] = got
        if layout.outer.size() > 1:
            scores = all_reduce_cpu(scores, group=layout.outer)
        return scores[first : first + count].tolist()


def _padded_rows(model, rows: list[list[int]], count: int, width: int) -> dict:
    """One micro-batch of the reward model: `rows` right-padded to [count, width] (rows past len(rows): one
    filler token each) and the position each score is read at. Past each length: filler that no score reads
    (causal attention, positions < length)."""
    pad = model.arch.pad_token_id
    ids = torch.full((count, width), pad if pad is not None else 0, dtype=torch.long)
    lengths = torch.ones(count, dtype=torch.long)
    for i, seq in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        lengths[i] = len(seq)
    return {"input_ids": ids, "positions": model.score_positions(ids, lengths, pad)}


def _stop_together(error: RewardError | None) -> None:
    """Collective over every rank (all of them score at the same point of a step): when any rank's
    reward functions failed, every rank raises a RewardError, so none is left waiting in the next
    collective; only the lowest rank that failed reports it (one line, once)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return

    rank, world = dist.get_rank(), dist.get_world_size()
    first = int(
        all_reduce_cpu(
            torch.tensor([rank if error is not None else world], dtype=torch.int64), op=dist.ReduceOp.MIN
        ).item()
    )
    if first < world:
        raise RewardError(f"{error} (rank {rank})" if rank == first else "failed on another rank", report=rank == first)
