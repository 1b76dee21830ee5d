"""The ReMax training loop, top to bottom. One step, on every rank (SPMD under torchrun):

    sync      actor TP/PP shards -> full HF tensors -> rollout engine (buckets)
    rollout   per prompt: n sampled responses + 1 greedy response, one engine request (rollout.dispatch)
    reward    score samples and greedy responses with the same reward
    resample  algo.dynamic_sampling: prompts whose samples all tie their greedy reward out, more drawn in
    pack      samples -> one right-padded batch with rewards and greedy baselines (batching.pad_sequences);
              with a token budget the rows are balanced over DP by tokens and packed into micro-batches
    logprobs  reference log-probs (when KL is on); the actor's own only for several mini-batches,
              on-policy the training forward gives them
    update    micro-batches through megatron's schedule (update.py): fused log-probs, advantage
              A = r(sample) - r(greedy) (+ per-token KL in the reward), loss / global token count, optimizer step
    metrics   global statistics of the step (step_metrics.py); rank 0 writes metrics.jsonl, TensorBoard, progress

Each stage is timed as time/<stage>_s; time/train_s = pack + logprobs + update. Eval is evaluation.py's;
checkpoints, exports, resume and stop signals are run_control.py's. ReMax (Li et al., 2024): the greedy
response's reward is the baseline, so no value model is trained and no normalisation is needed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from transformers import PreTrainedTokenizerBase

from remax_megatron.algo.kl_controller import KLController
from remax_megatron.batching import rollout_batch
from remax_megatron.checkpoint import CheckpointError
from remax_megatron.config import Config
from remax_megatron.data.prompts import Prompt, PromptSampler
from remax_megatron.evaluation import Evaluator
from remax_megatron.health import TrainingHealth
from remax_megatron.memory import TrainStateOffload, phase_memory
from remax_megatron.metrics import MetricsLogger
from remax_megatron.models.gpt import PolicyModel
from remax_megatron.optimizer import CpuAdamW, MegatronOptimizer
from remax_megatron.parallel import ProcessGroups
from remax_megatron.reward.overlong import shape_overlong
from remax_megatron.reward.scoring import RewardScorer
from remax_megatron.rollout import RolloutEngine, WeightSync
from remax_megatron.rollout.agent import env_columns, env_scores, make_dispatch, scored_text
from remax_megatron.rollout.dispatch import RolloutDispatch
from remax_megatron.rollout.dump import RolloutDump
from remax_megatron.rollout.dynamic_sampling import DynamicSampling, Scored
from remax_megatron.rollout.schedule import SyncThenGenerate, make_schedule, one_step_ahead
from remax_megatron.run_control import RunControl
from remax_megatron.startup_times import StartupClock
from remax_megatron.step_metrics import BehaviourCheck, DpReduce, StepMetrics
from remax_megatron.update import Updater


@dataclass
class Components:
    """Everything the loop uses, built once by remax_megatron.startup.build()."""

    cfg: Config
    groups: ProcessGroups
    actor: DistributedDataParallel  # megatron DDP around the actor's PolicyModel
    reference: PolicyModel | None  # frozen; None without KL
    optimizer: CpuAdamW | MegatronOptimizer
    scheduler: OptimizerParamScheduler
    engine: RolloutEngine
    scorer: RewardScorer
    tokenizer: PreTrainedTokenizerBase
    sampler: PromptSampler  # over the train prompts
    eval_prompts: list[Prompt]
    kl: KLController
    hf_dir: str  # the actor's HF directory (config and tokenizer go into checkpoints)
    startup: StartupClock = field(default_factory=StartupClock)  # launch to the first step, in parts


class Trainer:
    def __init__(self, parts: Components, logger: MetricsLogger):
        self.parts, self.cfg, self.groups, self.log = parts, parts.cfg, parts.groups, logger
        self.actor_module = parts.actor.module
        self.step = 0
        self.health = TrainingHealth(self.cfg, self.actor_module.arch.vocab_size)
        self.reduce = DpReduce(self.groups)
        self.updater = Updater(self.cfg, parts, self.reduce)
        self.metrics = StepMetrics(self.cfg, parts, self.reduce)
        self.behaviour = BehaviourCheck(
            self.cfg,
            self.actor_module,
            self.reduce,
            enabled=self.cfg.rollout.behaviour_logprobs and one_step_ahead(self.cfg),
        )
        self.run = RunControl(self.cfg, parts, self.groups, logger, self.health)
        self.sampling = DynamicSampling(self.cfg, self.groups, self.reduce) if self.cfg.algo.dynamic_sampling else None

    @functools.cached_property
    def dispatch(self) -> RolloutDispatch:
        """Built on first use, as what else needs the engine (a test of the update alone builds none)."""
        return make_dispatch(self.cfg, self.parts.engine, self.groups, self.parts.tokenizer)

    @functools.cached_property
    def schedule(self) -> SyncThenGenerate:
        """When each step's batch is generated: synced then generated, or one step ahead (rollout/schedule.py)."""
        return make_schedule(
            self.cfg,
            self.parts.sampler,
            lambda: self.dispatch,
            lambda: self.weight_sync,
            lambda: self.offload,
            self.behaviour,
            self._stage,
        )

    @functools.cached_property
    def dump(self) -> RolloutDump:
        """logging.rollouts_every: the step's rollouts as JSONL."""
        return RolloutDump(
            self.cfg.logging.rollouts_every, self.cfg.trainer.output_dir, self.groups, self.parts.tokenizer
        )

    @functools.cached_property
    def evaluator(self) -> Evaluator:
        return Evaluator(self.cfg, self.parts, self.dispatch, self.reduce, self.log)

    @functools.cached_property
    def offload(self) -> TrainStateOffload:
        """Frees the actor's training state while the engine generates (actor.offload_during_rollout)."""
        return TrainStateOffload(self.parts.actor, self.parts.optimizer, enabled=self.cfg.actor.offload_during_rollout)

    @functools.cached_property
    def weight_sync(self) -> WeightSync:
        """Actor -> engine sync (keeps its buffers between steps)."""
        return WeightSync(
            self.parts.engine, self.actor_module, bucket_mb=self.cfg.rollout.sync_bucket_mb, groups=self.groups
        )

    # ---- the loop ------------------------------------------------------------------------
    def fit(self, resume: str | None = None) -> bool:
        """Train up to trainer.steps (after resuming checkpoint `resume`); False when a stop signal ended it."""
        cfg = self.cfg
        if resume is not None:
            with self._stage("resume", {}, step=0):
                state = self.run.resume(resume)
                self.step, self.updater.skipped_updates = state["step"], state["skipped_updates"]
        if cfg.trainer.eval_every and self.step == 0:
            with self.parts.startup.part("eval"), self._stage("eval", {}, step=0):
                record = self.evaluator.evaluate(self.step, self._eval_rollouts)
            if record:  # no held-out prompts (data.eval_size=0): nothing to log
                self.log.log(record)
        while self.step < cfg.trainer.steps:
            self.parts.startup.step_starts()
            record = self.train_step()
            record.update(self.parts.startup.first_record())  # time/startup_s and its parts, once
            self.step += 1
            if cfg.trainer.eval_every and (self.step % cfg.trainer.eval_every == 0 or self.step == cfg.trainer.steps):
                with self._stage("eval", {}, step=self.step):  # its "step" is the record's
                    record.update(self.evaluator.evaluate(self.step, self._eval_rollouts))
            self.log.log(record)
            self.log.progress(self.step, record)
            for line in self.health.observe(record):  # the same records, so the same findings, on every rank
                self.log.warn(line)
            # The stop decision and the save are collective: a peer that dies here is one line too.
            with self._stage("checkpoint", {}, step=self.step):
                if not self.run.after_step(self.step, self.state_dict):
                    return False
        return True

    def state_dict(self) -> dict:
        """What a checkpoint holds besides the weights and the optimizer (resume continues exactly here)."""
        return {
            "sampler": self.schedule.sampler_state(),
            "scheduler": self.parts.scheduler.state_dict(),
            "kl": self.parts.kl.state_dict(),
            "skipped_updates": self.updater.skipped_updates,
            "model": self.run.model_fingerprint,
        }

    # ---- the step ------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, parts, updater = self.cfg, self.parts, self.updater
        times, t_step = {}, time.perf_counter()  # times: time/<stage>_s

        # sync + rollout: this step's prompts and their rollouts, and the policy version that generated them
        prompts, rollouts, sync, version = self.schedule.rollout(self.step, times)

        with self._stage("reward", times):
            r_sampled, r_greedy, reward_metrics = self._rewards(prompts, rollouts, times)
        times["time/reward_s"] -= times.setdefault("time/wait_s", 0.0)  # this rank's own scoring
        if self.sampling:  # prompts without signal dropped, more drawn, rolled out and scored until the step is full
            with self._stage("resample", times), self.offload.offloaded():  # its rounds' waits count in it
                (prompts, rollouts, r_sampled, r_greedy), sampling = self.sampling.refill(
                    self.step,
                    Scored(prompts, rollouts, r_sampled, r_greedy),
                    self.dispatch,
                    parts.sampler,
                    lambda more, their: self._rewards(more, their, {}),
                )

        with self._stage("pack", times):
            batch = rollout_batch(cfg, parts.tokenizer, self.actor_module, prompts, rollouts, r_sampled, r_greedy)
            batch, plan = updater.micro_batch_plan(batch)  # this rank's rows and micro-batches per update

        with self._stage("logprobs", times):
            # On-policy (one update per rollout) the training forward itself gives the rollout policy's
            # log-probs (same weights, no dropout): a separate pass only for several mini-batches.
            old_logprobs = updater.logprobs(self.actor_module, batch, plan) if cfg.trainer.mini_batches > 1 else None
            ref_logprobs = updater.reference_logprobs(batch, plan)
            behaviour_gap = self.behaviour.gap(batch, plan, version, updater.logprobs)

        with self._stage("update", times):
            update = updater.train_on(batch, old_logprobs, ref_logprobs, plan, step=self.step + 1)

        with self._stage("metrics", times):
            record = self.metrics.record(
                self.step + 1,
                batch,
                rollouts,
                r_sampled,
                r_greedy,
                update,
                ref_logprobs,
                reward_metrics,
                stale=version < self.step,
            )
            record.update(behaviour_gap)
            self.dump.write(self.step + 1, prompts, rollouts, r_sampled, r_greedy)  # logging.rollouts_every
            record.update(self.metrics.rollout_work(rollouts, self.dispatch))
            tokens = self.reduce.global_sum(float(batch["lengths"].sum()))
            num_sequences = int(self.reduce.global_sum(len(r_sampled)))
        # The adaptive KL controller's horizon counts the global batch's sequences (every DP rank's).
        parts.kl.update(record["kl/mean"] * record["response/length_mean"], num_sequences)
        step_time = time.perf_counter() - t_step
        times["time/train_s"] = times["time/pack_s"] + times["time/logprobs_s"] + times["time/update_s"]
        record.update(times)
        record.update(sampling if self.sampling else {})
        record.update(
            self.metrics.perf(prompts, rollouts, batch, step_time, times["time/train_s"], updater.has_reference)
        )
        record.update(
            self.metrics.bookkeeping(
                step_time,
                tokens,
                update,
                sync,
                self.schedule.sampler_state(),
                staleness=self.step - version,
                skipped_updates=updater.skipped_updates,
            )
        )
        return record

    def _eval_rollouts(self, prompts: list) -> list:
        """Greedy responses of the current weights for eval (this replica's `prompts`)."""
        self.schedule.sync(self.step)
        with self.offload.offloaded():
            return self.dispatch.generate(prompts, 0, self.step)

    def _rewards(self, prompts, rollouts, times: dict):
        """r(sample) [P * n] and r(greedy) [P * 1], one scoring call over both (its wait for the others: wait_s)."""
        turns, tokenizer = self.cfg.reward.turns, self.parts.tokenizer
        responses = [
            [(c.token_ids, scored_text(c, tokenizer, turns)) for c in r.sampled + [r.greedy]] for r in rollouts
        ]
        scores, metrics = env_scores(rollouts), {}  # rollout.env with reward(): the environment's
        if scores is None:
            scores, metrics = self.parts.scorer.score(
                prompts, responses, wait=lambda: self._stage("wait", times), response_columns=env_columns(rollouts)
            )
        scores = shape_overlong(scores, responses, self.cfg, metrics)  # reward.overlong_buffer: samples and greedy
        n = self.cfg.rollout.n
        return [s for row in scores for s in row[:n]], [row[n] for row in scores], metrics

    @contextlib.contextmanager
    def _stage(self, name: str, times: dict, step: int | None = None):
        """Time a stage (time/<name>_s), record its memory (memory.phase_memory) and name it in any
        failure, e.g. a collective timeout or a peer that died (`step`: default the step in progress).
        A CheckpointError keeps its own line (every rank has the same one)."""
        start = time.perf_counter()
        try:
            with phase_memory(name, times):
                yield
        except (RuntimeError, dist.DistBackendError) as e:
            if isinstance(e, (StageError, CheckpointError)):
                raise
            raise StageError(
                f"step {self.step + 1 if step is None else step}, stage {name!r} failed on rank "
                f"{dist.get_rank()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
        times[f"time/{name}_s"] = time.perf_counter() - start


class StageError(RuntimeError):
    """A stage of the step failed (a peer died, a collective timed out): names the step and stage."""
