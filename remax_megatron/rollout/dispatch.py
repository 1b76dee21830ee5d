"""A replica's prompts to the rollout engine and its rollouts back, the same on every rank of the replica.

    dispatch = RolloutDispatch(engine, groups, cfg.rollout, seed=cfg.trainer.seed)
    prompts = dispatch.share(global_prompts)          # this DP rank's contiguous share
    ticket = dispatch.submit(prompts, n, step)        # each model-parallel rank decodes a part
    rollouts = dispatch.collect(ticket)               # the parts gathered in order: n sampled + 1 greedy each

Prompt i of a step's global batch samples from `stream_seed(seed, step, i)` whichever rank or engine
decodes it, so the layout does not change what is sampled.
"""

from __future__ import annotations

import torch.distributed as dist

from remax_megatron.rollout.engine import SamplingParams, stream_seed


class RolloutDispatch:
    def __init__(self, engine, groups, rollout_cfg, seed: int):
        self.engine, self.groups, self.rollout_cfg, self.seed = engine, groups, rollout_cfg, seed
        self.decoded_tokens = 0  # tokens this rank's engine decoded for the last collect
        self._decoded_seen = 0  # the engine's decoded_tokens at the last collect

    def share(self, prompts: list) -> list:
        """This DP rank's contiguous share of the global prompt batch."""
        per_rank = len(prompts) // self.groups.dp_size
        return prompts[self.groups.dp_rank * per_rank : (self.groups.dp_rank + 1) * per_rank]

    def generate(self, prompts: list, n: int, step: int) -> list:
        """n sampled + 1 greedy per prompt of this replica; the same list on every rank of its
        model-parallel group."""
        return self.collect(self.submit(prompts, n, step))

    def submit(self, prompts: list, n: int, step: int, first_index: int = 0):
        """Start generating `prompts` (this replica's, of step `step`); `collect` gives the rollouts.
        Each rank of the model-parallel group decodes a distinct contiguous share of the replica's
        prompts (no rollout is computed twice). `first_index`: the global batch's place among the step's
        drawn prompts (algo.dynamic_sampling draws more than one batch a step)."""
        groups = self.groups
        lo, hi = contiguous_share(len(prompts), groups.mp_size, groups.mp_rank)
        # index of this replica's first prompt among the step's prompts
        first = first_index + groups.dp_rank * len(prompts)
        seeds = [stream_seed(self.seed, step, first + i) for i in range(lo, hi)]
        return self.engine.submit(
            [q.token_ids for q in prompts[lo:hi]],
            n=n,
            sampling=SamplingParams.from_config(self.rollout_cfg),
            seeds=seeds,
        )

    def collect(self, ticket) -> list:
        """The rollouts of `submit`'s ticket, the model-parallel group's shares gathered in order."""
        rollouts = self._local(ticket)
        self.engine.sleep()
        # what the engine decoded since the last collect: a local engine decodes at submit, a remote one
        # reports at collect
        self.decoded_tokens = self.engine.decoded_tokens - self._decoded_seen
        self._decoded_seen = self.engine.decoded_tokens
        return self._gather(rollouts) if self.groups.mp_size > 1 else rollouts

    def _local(self, ticket) -> list:
        """This rank's share of the rollouts of `ticket`."""
        return self.engine.collect(ticket)

    def _gather(self, rollouts: list) -> list:
        shares: list = [None] * self.groups.mp_size
        dist.all_gather_object(shares, rollouts, group=self.groups.mp)
        return [r for share in shares for r in share]


def contiguous_share(count: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when `count` items are split into `parts` contiguous, near-equal parts."""
    base, extra = divmod(count, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)
