"""algo.dynamic_sampling: a step trains only on prompts that carry a ReMax signal (DAPO's dynamic sampling).

A prompt whose n samples all tie its greedy reward has advantage 0 on every row: it teaches nothing. With
dynamic sampling such prompts are dropped, and more prompts are drawn, rolled out and scored (a "round"
each) until the global batch holds trainer.prompts_per_step prompts with signal, or
algo.dynamic_sampling_max_rounds rounds were run. Then the prompts kept, in the order they were drawn
(round, DP rank, place), are dealt back over the DP ranks in equal contiguous shares, each with its
rollouts and rewards (a sample stays paired with its own prompt's greedy reward). Prompts with signal
beyond the step's need are unused; if the rounds run out first, the step is topped up with the first
dropped prompts (they add no gradient, as in a step without dynamic sampling) and `sampling/short_prompts`
says how many.

    sampling = DynamicSampling(cfg, groups, reduce)
    scored, metrics = sampling.refill(step, Scored(prompts, rollouts, r_sampled, r_greedy), dispatch, sampler,
                                      score)           # fill(first, draw_more) underneath

Every prompt drawn advances the data loader: a checkpoint's sampler state counts them all, so a resumed
run draws exactly what the straight run drew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Scored:
    """This DP rank's prompts of one round, their rollouts and rewards: r_sampled [P * n], r_greedy [P]."""

    prompts: list
    rollouts: list
    r_sampled: list[float]
    r_greedy: list[float]

    def __iter__(self):
        return iter((self.prompts, self.rollouts, self.r_sampled, self.r_greedy))

    def items(self, n: int) -> list[tuple]:
        """Per prompt: (prompt, rollout, its n sampled rewards, its greedy reward)."""
        return [
            (q, r, self.r_sampled[i * n : (i + 1) * n], self.r_greedy[i])
            for i, (q, r) in enumerate(zip(self.prompts, self.rollouts))
        ]

    @staticmethod
    def of(items: list[tuple]) -> Scored:
        return Scored(
            [q for q, _, _, _ in items],
            [r for _, r, _, _ in items],
            [s for _, _, sampled, _ in items for s in sampled],
            [g for _, _, _, g in items],
        )


def has_signal(sampled: list[float], greedy: float) -> bool:
    """A prompt teaches something when one of its samples' rewards differs from its greedy reward."""
    return any(s != greedy for s in sampled)


class DynamicSampling:
    def __init__(self, cfg, groups, reduce):
        self.n, self.want = cfg.rollout.n, cfg.trainer.prompts_per_step
        self.max_rounds = cfg.algo.dynamic_sampling_max_rounds
        self.groups, self.reduce = groups, reduce

    def refill(self, step: int, first: Scored, dispatch, sampler, score: Callable) -> tuple[Scored, dict]:
        """`fill` with rounds that draw prompts_per_step more prompts from `sampler`, generate this rank's
        share through `dispatch` (seeded by their place among the step's drawn prompts) and `score(prompts,
        rollouts) -> (r_sampled, r_greedy, ...)` them."""

        def draw_more(round_: int) -> Scored:
            prompts = dispatch.share(sampler.next(self.want))
            rollouts = dispatch.collect(dispatch.submit(prompts, self.n, step, first_index=round_ * self.want))
            return Scored(prompts, rollouts, *score(prompts, rollouts)[:2])

        return self.fill(first, draw_more)

    def fill(self, first: Scored, draw_more: Callable[[int], Scored]) -> tuple[Scored, dict]:
        """The step's batch for this DP rank (prompts_per_step / dp prompts) and the sampling/* metrics.
        `draw_more(round)` draws prompts_per_step more prompts (globally), rolls out and scores this rank's
        share: rounds 1, 2, ... while the prompts with signal fall short."""
        kept, dropped = [], []  # this rank's, in order: (round, place, item)
        rounds, scored = 0, first
        while True:
            for place, item in enumerate(scored.items(self.n)):
                (kept if has_signal(item[2], item[3]) else dropped).append((rounds, place, item))
            rounds += 1
            with_signal = int(self.reduce.global_sum(float(len(kept))))
            if with_signal >= self.want or rounds >= self.max_rounds:
                break
            scored = draw_more(rounds)
        every_kept, every_dropped = self._gather(kept), self._gather(dropped)
        short = max(self.want - len(every_kept), 0)
        batch = every_kept[: self.want] + every_dropped[:short]
        per_rank = self.want // self.groups.dp_size
        mine = batch[self.groups.dp_rank * per_rank : (self.groups.dp_rank + 1) * per_rank]
        return Scored.of(mine), {
            "sampling/rounds": rounds,
            "sampling/prompts_drawn": rounds * self.want,
            "sampling/dropped_prompts": len(every_dropped) - short,
            "sampling/unused_prompts": max(len(every_kept) - self.want, 0),
            "sampling/short_prompts": short,
        }

    def _gather(self, mine: list[tuple]) -> list[tuple]:
        """Every DP rank's (round, place, item) in draw order: round, then DP rank, then place."""
        if self.groups.dp_size == 1:
            return [item for _, _, item in mine]
        ranks: list = [None] * self.groups.dp_size
        dist.all_gather_object(ranks, mine, group=self.groups.dp)
        ordered = sorted(
            (((r, rank, place), item) for rank, entries in enumerate(ranks) for r, place, item in entries),
            key=lambda entry: entry[0],
        )
        return [item for _, item in ordered]
