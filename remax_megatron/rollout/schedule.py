"""When a step's rollouts are generated relative to its update: the training side's one reader of
rollout.placement and rollout.max_staleness, chosen once at build.

    schedule = make_schedule(cfg, sampler, dispatch, weight_sync, offload, behaviour, stage)
    prompts, rollouts, sync, version = schedule.rollout(step, times)   # this DP rank's batch of step `step`
    schedule.sync(step)                                                  # weights -> engine (eval too)
    schedule.sampler_state()                                             # the data position a checkpoint records

- `SyncThenGenerate` (colocated, or separate with rollout.max_staleness=0): sync the current weights, then
  generate the step's batch.
- `OneStepAhead` (separate, staleness 1): the batch submitted during the last step's update (generated with
  the weights that update started from) is collected, the current weights are synced, and the next step's
  batch is submitted, to be generated on the rollout ranks while this one trains.

`dispatch`, `weight_sync` and `offload` are zero-argument callables giving the Trainer's lazily built
objects (a test of the update alone builds no engine); `stage(name, times)` times a stage.
"""

from __future__ import annotations

from collections.abc import Callable

NO_SYNC = {"bytes": 0, "buckets": 0}


def one_step_ahead(cfg) -> bool:
    """Whether the next step's batch is generated during this step's update (rollout.max_staleness=1)."""
    return cfg.rollout.placement == "separate" and cfg.rollout.max_staleness == 1


class SyncThenGenerate:
    def __init__(
        self, cfg, sampler, dispatch: Callable, weight_sync: Callable, offload: Callable, behaviour, stage: Callable
    ):
        self.cfg, self.sampler, self.behaviour, self.stage = cfg, sampler, behaviour, stage
        self.dispatch, self.weight_sync, self.offload = dispatch, weight_sync, offload
        # An engine on its own ranks keeps its weights between syncs; a colocated one may free them asleep.
        self.keeps_weights = cfg.rollout.placement == "separate"
        self.pending = None  # (prompts, ticket, version) generating meanwhile (one step ahead)
        self.sampler_before_pending = None  # the sampler's state before the pending batch was drawn
        self.synced_step: int | None = None  # the policy version (updates applied) of the weights last synced

    def rollout(self, step: int, times: dict) -> tuple[list, list, dict, int]:
        """Step `step`'s prompts (this DP rank's), their rollouts, the weight sync's stats and the policy
        version (updates applied to the engine's weights) that generated them."""
        sync = dict(NO_SYNC)
        fresh = self.pending is None  # nothing generated ahead: this step's batch from the current weights
        if fresh:
            with self.stage("sync", times):
                # The sync wakes only the engine's weights; generate wakes its KV cache after the offload.
                sync = self.sync(step)
        with self.stage("rollout", times), self.offload().offloaded():
            if fresh:  # a local engine decodes here
                self.pending = self._submit(step, current=step)
            prompts, ticket, version = self.pending
            self.pending, self.sampler_before_pending = None, None
            rollouts = self.dispatch().collect(ticket)
        sync = self._generate_ahead(step, times, sync)
        times.setdefault("time/sync_s", 0.0)  # the last step of a run ahead has nothing to sync
        return prompts, rollouts, sync, version

    def _generate_ahead(self, step: int, times: dict, sync: dict) -> dict:  # noqa: ARG002 - OneStepAhead overrides it
        return sync

    def sync(self, step: int) -> dict:
        """Weights -> engine. An engine that keeps its weights: only when they are older than the actor's."""
        if self.keeps_weights and self.synced_step == step:
            return dict(NO_SYNC)
        stats = self.weight_sync()()
        self.synced_step = step
        self.behaviour.keep(step)
        return stats

    def _submit(self, step: int, current: int) -> tuple[list, object, int]:
        """Draw step `step`'s prompts and submit this DP rank's share to the engine: (prompts, ticket, version).
        A batch drawn ahead (step > `current`) keeps the sampler's state from before it: a checkpoint saved
        while it is in flight resumes from there, so a stopped run draws those prompts again (the in-flight
        batch is dropped, never trained twice or lost)."""
        before = self.sampler.state_dict()
        dispatch = self.dispatch()
        prompts = dispatch.share(self.sampler.next(self.cfg.trainer.prompts_per_step))
        if step > current:
            self.sampler_before_pending = before
        return prompts, dispatch.submit(prompts, self.cfg.rollout.n, step), self.synced_step

    def sampler_state(self) -> dict:
        """The data loader's position as a checkpoint must record it (before a batch drawn ahead)."""
        return self.sampler_before_pending or self.sampler.state_dict()


class OneStepAhead(SyncThenGenerate):
    def _generate_ahead(self, step: int, times: dict, sync: dict) -> dict:
        """After collecting step `step`'s batch: sync the current weights and submit the next step's batch."""
        if step + 1 < self.cfg.trainer.steps:
            with self.stage("sync", times):
                sync = self.sync(step)
            self.pending = self._submit(step + 1, current=step)
        return sync


def make_schedule(
    cfg, sampler, dispatch: Callable, weight_sync: Callable, offload: Callable, behaviour, stage: Callable
) -> SyncThenGenerate:
    kind = OneStepAhead if one_step_ahead(cfg) else SyncThenGenerate
    return kind(cfg, sampler, dispatch, weight_sync, offload, behaviour, stage)
