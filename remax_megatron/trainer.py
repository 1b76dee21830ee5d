"""The ReMax training loop, top to bottom.

One step, on every rank (SPMD under torchrun):

    sync      actor TP/PP shards -> full HF tensors -> rollout engine (buckets)
    rollout   per prompt: n sampled responses + 1 greedy response, one engine request
    reward    score samples and greedy responses with the same reward
    pack      samples -> one padded batch with rewards and greedy baselines; with a token budget the rows
              are balanced over DP by tokens and grouped into micro-batches (remax_megatron/batching)
    logprobs  reference log-probs (when KL is on); the actor's own only for several mini-batches,
              on-policy the training forward gives them
    update    micro-batches through megatron's schedule: fused log-probs, advantage
              A = r(sample) - r(greedy) (+ per-token KL in the reward), loss / global token count,
              optimizer step
    metrics   global statistics of the step; rank 0 writes metrics.jsonl, TensorBoard, progress

Each stage is timed as time/<stage>_s; time/train_s = pack + logprobs + update.

ReMax (Li et al., 2024): the greedy response's reward is the baseline, so no
value model is trained and no normalisation is needed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from transformers import PreTrainedTokenizerBase

from remax_megatron.algo.kl_controller import KLController
from remax_megatron.algo.rollout_correction import STAT_KEYS as IS_STAT_KEYS, correction_metrics, correction_weights
from remax_megatron.checkpoint import STEP_DIR, CheckpointError, latest_checkpoint, load_checkpoint, \
    preemption_save_refusal, save_checkpoint, step_dir_name
from remax_megatron.config import Config
from remax_megatron.kernels import compute_advantages, logprob_gradient, remax_loss
from remax_megatron.flops import forward_flops, peak_tflops
from remax_megatron.health import TrainingHealth
from remax_megatron.memory import TrainStateOffload, phase_memory
from remax_megatron.metrics import MetricsLogger, count_weighted, global_mean, print0, reduce_totals
from remax_megatron.models.forward import broadcast_from_last_stage, forward_only, run_schedule, to_model_device
from remax_megatron.data.prompts import Prompt, PromptSampler
from remax_megatron.models.arch import packed_attention
from remax_megatron.models.gpt import PolicyModel, sequence_multiple
from remax_megatron.models.lora import adapters_disabled, has_adapters
from remax_megatron.models.moe import LoadBalancing, end_replay, padding_mask, replay_routes
from remax_megatron.batching import MicroBatch, assemble, exchange_rows, fixed_micro_batches, model_inputs, \
    model_labels, pad_sequences, plan_step, take_rows, to_rows, to_sequences
from remax_megatron.optimizer import CpuAdamW, MegatronOptimizer, restore_config_hyperparameters, schedule_changes
from remax_megatron.parallel import ProcessGroups, all_reduce_cpu
from remax_megatron.processes import preemption_flag
from remax_megatron.resume import model_fingerprint
from remax_megatron.reward.scoring import RewardScorer
from remax_megatron.rollout import RolloutEngine, SamplingParams, WeightSync, logprob_mismatch, stream_seed
from remax_megatron.weights.export import save_hf_dir

# Statistics of the loss that are summed over micro-batches and DP ranks (each already normalised globally).
LOSS_STATS = ("loss", "pg_loss", "kl", "entropy", "clip_frac")
# MoE: the update's load-balancing loss (mean over layers) and expert load (models/moe.py)
MOE_STATS = ("moe/aux_loss", "moe/expert_load")
REPLAY_STATS = ("moe/route_mismatch_frac",)  # rollout.routing_replay only


@dataclass
class Components:
    """Everything the loop uses, built once by remax_megatron.startup.build()."""

    cfg: Config
    groups: ProcessGroups
    actor: DistributedDataParallel           # megatron DDP around the actor's PolicyModel
    reference: PolicyModel | None            # frozen; None without KL
    optimizer: CpuAdamW | MegatronOptimizer
    scheduler: OptimizerParamScheduler
    engine: RolloutEngine
    scorer: RewardScorer
    tokenizer: PreTrainedTokenizerBase
    sampler: PromptSampler                   # over the train prompts
    eval_prompts: list[Prompt]
    kl: KLController
    hf_dir: str                              # the actor's HF directory (config and tokenizer go into checkpoints)


class Trainer:
    def __init__(self, parts: Components, logger: MetricsLogger):
        self.parts, self.cfg, self.groups, self.log = parts, parts.cfg, parts.groups, logger
        self.actor_module = parts.actor.module
        self.step = 0
        self.skipped_updates = 0
        self._decoded_tokens = 0  # tokens this rank's engine decoded in the step's rollout
        self._decoded_seen = 0    # the engine's decoded_tokens at the last collect
        self.preempt = preemption_flag()
        self._save_seconds = 0.0  # the last save's duration: a stop-signal save must fit torchrun's grace
        self._pending = None  # separate placement, staleness 1: (prompts, ticket, version) generating meanwhile
        self._sampler_before_pending = None  # the sampler's state before the pending batch was drawn
        self._synced_step: int | None = None  # the policy version (updates applied) of the weights last synced
        self._snapshots: dict[int, list[torch.Tensor]] = {}  # rollout.behaviour_logprobs: version -> weights
        self.health = TrainingHealth(self.cfg, self.actor_module.arch.vocab_size)
        # MoE: the load-balancing loss and expert-load statistics (hooks on the actor's routers)
        self.balance = LoadBalancing(self.actor_module, self.cfg.algo.moe_aux_loss, self.cfg.algo.moe_aux_loss_coef,
                                     self.groups.tp, self.groups.dp, self.groups.pp) \
            if self.actor_module.arch.is_moe else None

    @functools.cached_property
    def offload(self) -> TrainStateOffload:
        """Frees the actor's training state while the engine generates (actor.offload_during_rollout)."""
        return TrainStateOffload(self.parts.actor, self.parts.optimizer, enabled=self.cfg.actor.offload_during_rollout)

    @functools.cached_property
    def weight_sync(self) -> WeightSync:
        """Actor -> engine sync (keeps its buffers between steps)."""
        return WeightSync(self.parts.engine, self.actor_module, bucket_mb=self.cfg.rollout.sync_bucket_mb,
                          groups=self.groups)

    # ---- the step ------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, parts = self.cfg, self.parts
        times: dict[str, float] = {}
        t_step = time.perf_counter()

        # sync + rollout: this step's prompts and their rollouts, and the policy version that generated them
        prompts, rollouts, sync, version = self._rollout(times)

        with self._stage("reward", times):
            r_sampled, r_greedy, reward_metrics = self._rewards(prompts, rollouts)

        with self._stage("pack", times):
            batch = self._pack(prompts, rollouts, r_sampled, r_greedy)
            batch, plan = self._plan(batch)  # this rank's rows and micro-batches per update

        with self._stage("logprobs", times):
            # On-policy (one update per rollout) the training forward itself gives the rollout policy's
            # log-probs (same weights, no dropout): a separate pass only for several mini-batches.
            old_logprobs = self._logprobs(self.actor_module, batch, plan) if cfg.trainer.mini_batches > 1 else None
            ref_logprobs = self._reference_logprobs(batch, plan)
            behaviour_gap = self._behaviour_gap(batch, plan, version)

        with self._stage("update", times):
            update = self._train_on(batch, old_logprobs, ref_logprobs, plan)

        with self._stage("metrics", times):
            record = self._step_record(batch, rollouts, r_sampled, r_greedy, update, ref_logprobs, reward_metrics,
                                       stale=version < self.step)
            record.update(behaviour_gap)
            record.update(self._rollout_work(rollouts))
            tokens = self._global_sum(float(batch["lengths"].sum()))
            num_sequences = int(self._global_sum(len(r_sampled)))
        # The adaptive KL controller's horizon counts the global batch's sequences (every DP rank's).
        parts.kl.update(record["kl/mean"] * record["response/length_mean"], num_sequences)
        step_time = time.perf_counter() - t_step
        times["time/train_s"] = times["time/pack_s"] + times["time/logprobs_s"] + times["time/update_s"]
        record.update(times)
        record.update(self._perf(prompts, rollouts, batch, step_time, times["time/train_s"]))
        record.update({
            "time/step_s": step_time, "throughput/tokens_per_s": tokens / step_time,
            # What the training forward ran: every row's tokens, and with the padding it computed.
            "batch/real_tokens": tokens, "batch/computed_tokens": update.computed_tokens,
            "sync/bytes": sync["bytes"], "sync/buckets": sync["buckets"], "kl/coef": parts.kl.coef,
            "lr": parts.optimizer.param_groups[0]["lr"], "optim/skipped_updates": self.skipped_updates,
            # This rank's optimizer state (Adam moments, fp32 main weights): adapter-sized with LoRA.
            "optim/state_mib": _distinct_bytes(parts.optimizer.state_tensors()) / 2**20,
            # Where the data loader stands after this step (resume must continue exactly here).
            "data/epoch": self._sampler_state()["epoch"], "data/position": self._sampler_state()["position"],
            # updates between the weights that generated this batch and the ones it trains (separate placement)
            "rollout/staleness": self.step - version,
        })
        return record

    def _rollout(self, times: dict) -> tuple[list, list, dict, int]:
        """This step's prompts (this DP rank's), their rollouts, the weight sync's stats and the policy
        version (updates applied to the engine's weights) that generated them.

        Colocated, or separate with rollout.max_staleness=0: sync the current weights, then generate.
        Separate with staleness 1: the batch submitted during the last step's update (generated with the
        weights that update started from) is collected, the current weights are synced, and the next
        step's batch is submitted, to be generated on the rollout ranks while this one trains."""
        sync = {"bytes": 0, "buckets": 0}
        fresh = self._pending is None  # nothing generated ahead: this step's batch from the current weights
        if fresh:
            with self._stage("sync", times):
                # The sync wakes only the engine's weights; generate wakes its KV cache after the offload.
                sync = self._sync()
        with self._stage("rollout", times), self.offload.offloaded():
            if fresh:  # a local engine decodes here
                self._pending = self._submit_step(self.step)
            prompts, ticket, version = self._pending
            self._pending, self._sampler_before_pending = None, None
            rollouts = self._collect(ticket)
        if self._ahead and self.step + 1 < self.cfg.trainer.steps:
            with self._stage("sync", times):
                sync = self._sync()
            self._pending = self._submit_step(self.step + 1)
        times.setdefault("time/sync_s", 0.0)  # the last step of a run ahead has nothing to sync
        return prompts, rollouts, sync, version

    @property
    def _ahead(self) -> bool:
        """Whether the next step's batch is generated during this step's update (rollout.max_staleness=1)."""
        return self.cfg.rollout.placement == "separate" and self.cfg.rollout.max_staleness == 1

    def _sync(self) -> dict:
        """Weights -> engine. Separate placement: only when the engine's weights are older than the actor's."""
        if self.cfg.rollout.placement == "separate" and self._synced_step == self.step:
            return {"bytes": 0, "buckets": 0}
        stats = self.weight_sync()
        self._synced_step = self.step
        self._snapshot()
        return stats

    def _snapshot(self) -> None:
        """rollout.behaviour_logprobs: keep the weights just synced (policy version self.step) until the batch
        they generate has trained; older ones are dropped."""
        if not (self.cfg.rollout.behaviour_logprobs and self._ahead):
            return
        self._snapshots = {v: w for v, w in self._snapshots.items() if v >= self.step - 1}
        self._snapshots[self.step] = [p.detach().clone() for p in self.actor_module.parameters()]

    def _behaviour_gap(self, batch: dict, plan, version: int) -> dict:
        """rollout.behaviour_logprobs: the engine's log-probs against the actor version that generated the batch
        (max over the batch, every DP rank's): the engine/trainer mismatch without the policy's lag."""
        if not (self.cfg.rollout.behaviour_logprobs and self._ahead):
            return {}
        params, snapshot = list(self.actor_module.parameters()), self._snapshots[version]
        _swap_data(params, snapshot)  # the generating version in, the current weights held by the snapshot
        try:
            behaviour = self._logprobs(self.actor_module, batch, plan)
        finally:
            _swap_data(params, snapshot)
        local = None
        if self.groups.is_last_stage:
            gap = logprob_mismatch(behaviour, batch["engine_logprobs"], batch["response_mask"].bool(),
                                   threshold=self.cfg.rollout.logprob_warn_threshold)
            local = {"max": gap["max"]}
        totals = reduce_totals(self._from_last_stage(local, ("max",)), self._dp_group, maximum=("max",))
        return {"logprob/engine_vs_behaviour_max_diff": totals["max"]}

    def _submit_step(self, step: int) -> tuple[list, object, int]:
        """Draw step `step`'s prompts and submit this DP rank's share to the engine: (prompts, ticket, version).
        A batch drawn ahead keeps the sampler's state from before it: a checkpoint saved while it is in flight
        resumes from there, so a stopped run draws those prompts again (the in-flight batch is dropped, never
        trained twice or lost)."""
        before = self.parts.sampler.state_dict()
        prompts = self._local_share(self.parts.sampler.next(self.cfg.trainer.prompts_per_step))
        if step > self.step:
            self._sampler_before_pending = before
        return prompts, self._submit(prompts, self.cfg.rollout.n, step), self._synced_step

    def _sampler_state(self) -> dict:
        """The data loader's position as a checkpoint must record it (before a batch drawn ahead)."""
        return self._sampler_before_pending or self.parts.sampler.state_dict()

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
            raise StageError(f"step {self.step + 1 if step is None else step}, stage {name!r} failed on rank "
                             f"{dist.get_rank()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                             ) from e
        times[f"time/{name}_s"] = time.perf_counter() - start

    # ---- pieces of the step ----------------------------------------------------------------
    def _local_share(self, prompts: list) -> list:
        """This DP rank's contiguous share of the global prompt batch."""
        per_rank = len(prompts) // self.groups.dp_size
        return prompts[self.groups.dp_rank * per_rank:(self.groups.dp_rank + 1) * per_rank]

    def _generate(self, prompts: list, n: int) -> list:
        """n sampled + 1 greedy per prompt of this replica; the same list on every rank of its
        model-parallel group."""
        return self._collect(self._submit(prompts, n, self.step))

    def _submit(self, prompts: list, n: int, step: int):
        """Start generating `prompts` (this replica's, of step `step`); `_collect` gives the rollouts.

        Each rank of the model-parallel group decodes a distinct contiguous share of the replica's prompts
        (no rollout is computed twice). Prompt i of the step's global batch samples from
        `stream_seed(trainer.seed, step, i)` whichever rank or engine decodes it.
        """
        groups = self.groups
        lo, hi = _share(len(prompts), groups.mp_size, groups.mp_rank)
        first = groups.dp_rank * len(prompts)  # index of this replica's first prompt in the global batch
        seeds = [stream_seed(self.cfg.trainer.seed, step, first + i) for i in range(lo, hi)]
        return self.parts.engine.submit([q.token_ids for q in prompts[lo:hi]], n=n,
                                        sampling=SamplingParams.from_config(self.cfg.rollout), seeds=seeds)

    def _collect(self, ticket) -> list:
        """The rollouts of `_submit`'s ticket, the model-parallel group's shares gathered in order."""
        groups = self.groups
        rollouts = self.parts.engine.collect(ticket)
        self.parts.engine.sleep()
        # what the engine decoded since the last collect: a local engine decodes at submit, a remote one
        # reports at collect
        self._decoded_tokens = self.parts.engine.decoded_tokens - self._decoded_seen
        self._decoded_seen = self.parts.engine.decoded_tokens
        if groups.mp_size > 1:
            shares: list = [None] * groups.mp_size
            dist.all_gather_object(shares, rollouts, group=groups.mp)
            rollouts = [r for share in shares for r in share]
        return rollouts

    def _pad_id(self) -> int:
        tok = self.parts.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def _decode(self, ids: list[int]) -> str:
        return self.parts.tokenizer.decode(ids, skip_special_tokens=True)

    def _rewards(self, prompts, rollouts):
        """r(sample) [P * n] and r(greedy) [P * 1], one scoring call over both."""
        responses = [[(c.token_ids, self._decode(c.token_ids)) for c in r.sampled + [r.greedy]] for r in rollouts]
        scores, metrics = self.parts.scorer.score(prompts, responses)
        n = self.cfg.rollout.n
        return [s for row in scores for s in row[:n]], [row[n] for row in scores], metrics

    def _pack(self, prompts, rollouts, r_sampled, r_greedy) -> dict:
        """The samples as one right-padded batch (batching.pad_sequences) with their rewards
        [B] and their prompt's greedy reward [B] (the baseline)."""
        n = self.cfg.rollout.n
        batch = pad_sequences([q.token_ids for q in prompts for _ in range(n)],
                               [c for r in rollouts for c in r.sampled], pad_id=self._pad_id(),
                               pad_to_multiple=sequence_multiple(self.actor_module))
        batch["rewards"] = torch.tensor(r_sampled, dtype=torch.float32)                      # [B]
        batch["baseline"] = torch.tensor(r_greedy, dtype=torch.float32).repeat_interleave(n)  # [B]
        return batch

    def _plan(self, batch: dict) -> tuple[dict, list[list[MicroBatch]]]:
        """This rank's rows and its micro-batches per update (remax_megatron.batching).

        trainer.micro_batch_tokens = 0: the rows stay, micro_batch_size rows per micro-batch, all as wide as
        the batch. Otherwise each update's rows are balanced over DP by tokens (a row carries its reward and
        its prompt's greedy reward) and grouped under the token budget, packed with trainer.pack_sequences;
        every DP rank runs as many micro-batches."""
        t = self.cfg.trainer
        rows, width = batch["input_ids"].shape
        per_update = rows // t.mini_batches
        if not t.micro_batch_tokens:
            return batch, [fixed_micro_batches(per_update, t.micro_batch_size, width, start=u * per_update)
                           for u in range(t.mini_batches)]
        shapes = [(batch["lengths"].tolist(), width)]  # every DP rank's row lengths and batch width
        if self.groups.dp_size > 1:
            mine, shapes = shapes[0], [None] * self.groups.dp_size
            dist.all_gather_object(shapes, mine, group=self.groups.dp)
        plan = plan_step([lengths for lengths, _ in shapes], t.mini_batches, t.micro_batch_tokens,
                         sequence_multiple(self.actor_module), t.pack_sequences)
        if self.groups.dp_size == 1:
            return take_rows([batch], plan.sources[0]), plan.updates[0]
        me, widest = self.groups.dp_rank, max(w for _, w in shapes)
        return exchange_rows(batch, plan.sources, me, widest, self.groups.dp), plan.updates[me]

    def _micro_batches(self, batch: dict, micro: list[MicroBatch], extra: dict | None = None) -> list[dict]:
        """The micro-batches' tensors (batching.assemble)."""
        path = packed_attention()
        multiple = sequence_multiple(self.actor_module)
        return [assemble(batch, m, path, extra, multiple) for m in micro]

    @torch.no_grad()
    def _logprobs(self, model, batch: dict, plan: list[list[MicroBatch]]) -> torch.Tensor | None:
        """Per-token log-probs [B, S] of the batch's labels under `model` (last stage; None elsewhere)."""
        temperature = self.cfg.rollout.temperature
        micro = [m for update in plan for m in update]
        out = forward_only(model, self._micro_batches(batch, micro),
                           lambda m, hidden, mb: to_sequences(mb, m.token_logprobs(hidden, model_labels(mb),
                                                                                   temperature=temperature)[0]),
                           inputs=model_inputs)
        return _scatter(out, micro, batch["input_ids"].shape) if out else None

    @property
    def _has_reference(self) -> bool:
        """KL against a reference: a frozen reference model, or a LoRA actor's own base (adapters off)."""
        return self.parts.reference is not None or (self.cfg.algo.kl_coef > 0 and has_adapters(self.actor_module))

    def _reference_logprobs(self, batch: dict, plan: list[list[MicroBatch]]) -> torch.Tensor | None:
        """The KL reference's log-probs [B, S] (last stage); None without KL. A LoRA actor is its own
        reference with its adapters switched off (no second model is built)."""
        if self.parts.reference is not None:
            return self._logprobs(self.parts.reference, batch, plan)
        if not self._has_reference:
            return None
        with adapters_disabled(self.actor_module):
            return self._logprobs(self.actor_module, batch, plan)

    def _train_on(self, batch, old_logprobs, ref_logprobs, plan: list[list[MicroBatch]] | None = None) -> "Update":
        """One optimizer update per entry of `plan` (its micro-batches; default `_plan(batch)`'s) over the
        rollout batch.

        The loss of every update is normalised by its GLOBAL response-token (sequence) count, summed over
        its micro-batches and DP ranks, so how its rows are grouped does not change it. The advantages
        are computed per micro-batch inside the loss (remax_megatron.kernels.compute_advantages: per
        row, so equal to a whole-batch call) from the rollout policy's log-probs: `old_logprobs` when
        given (several mini-batches), else the training forward's own, detached (on-policy: the
        weights that produced the rollout, before this update).
        """
        cfg, parts = self.cfg, self.parts
        if plan is None:
            batch, plan = self._plan(batch)
        summed = {k: 0.0 for k in LOSS_STATS + (MOE_STATS if self.balance else ())
                  + (REPLAY_STATS if self.balance and cfg.rollout.routing_replay else ())}
        grad_norms, behaviour, advantages, computed = [], [], [], 0
        for update in plan:
            rows = torch.tensor([r for m in update for r in m.rows], dtype=torch.long)
            num_tokens = self._dp_sum(batch["response_mask"][rows].sum().double()).item()
            num_seqs = self._dp_sum(torch.tensor(float(len(rows)), dtype=torch.float64)).item()
            micro = self._micro_batches(batch, update, {"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs})
            computed += sum(mb["input_ids"].numel() for mb in micro)
            if self.balance:  # normalised by every token the routers see (prompt and response, no padding)
                self.balance.begin_update(self._dp_sum(batch["lengths"][rows].sum().double()).item(), num_seqs)
            stats = self._forward_backward(micro, num_tokens, num_seqs, behaviour, advantages)
            if self.balance:
                stats.update(self.balance.end_update())
                stats["loss"] += self.balance.total_loss(stats)
            ok, norm = parts.optimizer.step()
            if ok:
                parts.scheduler.step(increment=1)
            else:
                self.skipped_updates += 1
                print0(f"step {self.step + 1}: skipped an update (grad norm {norm}): the weights stay as they were")
            parts.optimizer.zero_grad()
            grad_norms.append(norm)
            for k in summed:
                summed[k] += stats.get(k, 0.0) / len(plan)
        summed["grad_norm"] = sum(grad_norms) / len(grad_norms)
        last = self.groups.is_last_stage
        micro = [m for update in plan for m in update]
        shape = batch["input_ids"].shape
        # The step's bookkeeping stays on the CPU: one transfer each, not a host sync per micro-batch.
        return Update(stats=summed, logprobs=_scatter(behaviour, micro, shape) if last else None,
                      advantages=_scatter(advantages, micro, shape) if last else None,
                      computed_tokens=self._global_sum(float(computed)))

    def _forward_backward(self, micro: list[dict], num_tokens: float, num_seqs: float,
                          behaviour: list, advantages: list) -> dict:
        """Megatron's schedule over the micro-batches (gradients accumulate); appends each micro-batch's
        rollout-policy log-probs and advantages [b, w] to `behaviour` / `advantages` (last stage).

        A micro-batch's loss, advantages and log-probs are in the sequence layout (one row per sample); the
        model runs its input rows (remax_megatron.batching: padded rows, or packed ones with their attention
        boundaries), whose per-token values `to_rows` / `to_sequences` move between the two."""
        cfg, model = self.cfg, self.actor_module
        off_policy = cfg.trainer.mini_batches > 1
        kl_in_loss = cfg.algo.kl_mode == "loss"
        correction = cfg.algo.rollout_correction
        def step_fn(data_iterator, ddp_model):
            mb = to_model_device(next(data_iterator), model)
            input_ids, inputs = model_inputs(mb)
            moe = {}
            if self.balance:  # which tokens are padding, and for seq_aux which sequence each token is of
                moe = {"padding_mask": padding_mask(model, input_ids, padding=mb["padding"])}
                self.balance.set_sequences(mb.get("segments"))
            if "routed_experts" in mb:  # rollout.routing_replay: the engine's experts for these tokens
                replay_routes(model, mb["routed_experts"])
            hidden = ddp_model(input_ids, _positions(input_ids), **inputs, **moe)

            def loss_fn(output):
                old, ref = mb.get("old_logprobs"), mb.get("ref_logprobs")
                kl_in_reward = ref is not None and not kl_in_loss
                agg = dict(loss_agg_mode=cfg.algo.loss_agg, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
                clip = cfg.algo.advantage_clip or None
                # Without a KL in the reward the advantages need no log-probs [b, S].
                adv = None if kl_in_reward else compute_advantages(mb["rewards"], mb["baseline"],
                                                                   mb["response_mask"], clip=clip)
                # On-policy without KL the loss is linear in the log-probs: its gradient is known before the
                # output layer runs, and the fused kernel takes it in its forward pass (no logits recomputed).
                # A rollout correction weighs each token by its own log-prob: not known before.
                hint = logprob_gradient(adv, mb["response_mask"], **agg) \
                    if old is None and ref is None and correction == "none" else None
                logprobs, entropy = model.token_logprobs(output, model_labels(mb), temperature=cfg.rollout.temperature,
                                                         with_entropy=True,
                                                         grad_hint=to_rows(mb, hint) if hint is not None else None)
                logprobs, entropy = to_sequences(mb, logprobs), to_sequences(mb, entropy)  # [b, w]
                rollout_policy = old if old is not None else logprobs.detach()  # [b, S]
                if kl_in_reward:
                    adv = compute_advantages(mb["rewards"], mb["baseline"], mb["response_mask"], rollout_policy,
                                             ref, kl_coef=self.parts.kl.coef, clip=clip)  # [b, S]
                behaviour.append(rollout_policy)  # stays on the device: one copy to the host per update
                advantages.append(adv)
                # algo.rollout_correction: pi_actor_old / pi_engine per token, from the rollout policy's log-probs
                is_weights = None if correction == "none" else correction_weights(
                    rollout_policy, mb["engine_logprobs"], mb["response_mask"], correction, cfg.algo.rollout_is_cap)[0]
                loss, stats = remax_loss(
                    logprobs, adv, mb["response_mask"], **agg,
                    old_logprobs=old if off_policy else None, clip_eps=cfg.algo.clip_ratio,
                    ref_logprobs=ref if kl_in_loss else None, kl_coef=self.parts.kl.coef,
                    kl_estimator=cfg.algo.kl_estimator, entropy=entropy, is_weights=is_weights)
                # A non-finite loss gives non-finite grads: the optimizer skips that update.
                local_tokens = mb["response_mask"].sum().to(torch.int)
                return loss, local_tokens, {k: v.detach().float() for k, v in stats.items()}

            return hidden, loss_fn

        try:
            outputs = run_schedule(model, step_fn, micro, forward_only=False, wrapped=self.parts.actor)
        finally:
            if self.balance:
                end_replay(model)
        local = {k: sum(float(out[k]) for out in outputs if k in out) for k in LOSS_STATS} \
            if self.groups.is_last_stage else None
        return reduce_totals(self._from_last_stage(local, LOSS_STATS), self._dp_group)

    # ---- metrics -------------------------------------------------------------------------
    @property
    def _dp_group(self):
        """The group metrics are reduced over (None at DP=1: nothing to reduce)."""
        return self.groups.dp if self.groups.dp_size > 1 else None

    def _dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_cpu(tensor, group=self._dp_group) if self._dp_group is not None else tensor

    def _from_last_stage(self, local: dict | None, keys: tuple[str, ...]) -> dict[str, float]:
        """`local` (given on the last pipeline stage only, where the tokens' statistics live) on every stage."""
        vec = torch.tensor([local[k] for k in keys], dtype=torch.float64) if self.groups.is_last_stage else None
        return dict(zip(keys, broadcast_from_last_stage(vec, (len(keys),), torch.float64).tolist()))

    def _perf(self, prompts, rollouts, batch, step_time: float, train_time: float) -> dict:
        """Model TFLOP/s per device and MFU of the step and of its train stage (remax_megatron.flops)."""
        arch = self.actor_module.arch
        rows = [len(q.token_ids) + len(c.token_ids) for q, r in zip(prompts, rollouts) for c in r.sampled + [r.greedy]]
        rollout = forward_flops(arch, rows)
        rm = self.parts.scorer.reward_model
        reward = forward_flops(rm.arch, rows) if rm is not None else 0.0
        # forward + backward (3 forwards' worth), old log-probs (several mini-batches only), reference
        passes = 3 + (self.cfg.trainer.mini_batches > 1) + self._has_reference
        train = passes * forward_flops(arch, batch["lengths"].tolist())
        # Prompts are split over DP only: the ranks of one model-parallel group share one replica's work.
        step_flops, train_flops = (float(x) for x in self._dp_sum(torch.tensor(
            [rollout + reward + train, train], dtype=torch.float64)))
        world = dist.get_world_size()
        out = {"perf/tflops_per_device": step_flops / step_time / world / 1e12,
               "perf/train_tflops_per_device": train_flops / train_time / world / 1e12}
        peak = peak_tflops(self.actor_module.config.params_dtype, self.cfg.trainer.peak_tflops)
        if peak:
            out["perf/mfu"] = out["perf/tflops_per_device"] / peak
            out["perf/mfu_train"] = out["perf/train_tflops_per_device"] / peak
        return out

    def _rollout_work(self, rollouts) -> dict:
        """Tokens the engines decoded this step over the tokens of the global batch's completions:
        1.0 when no rank decodes a prompt that another rank (or engine) also decodes."""
        tokens = self._global_sum(float(sum(len(c.token_ids) for r in rollouts for c in r.sampled + [r.greedy])))
        # Every rank of a TP engine counts its engine's tokens: count each engine once.
        decoded = all_reduce_cpu(torch.tensor(self._decoded_tokens / self.parts.engine.group_size, dtype=torch.float64))
        return {"rollout/tokens": tokens, "rollout/decoded_per_token": float(decoded) / max(tokens, 1.0)}

    def _global_sum(self, value: float) -> float:
        return reduce_totals({"value": value}, self._dp_group)["value"]

    def _dp_mean(self, values: list[float]) -> float:
        return global_mean(values, self._dp_group)

    def _step_record(self, batch, rollouts, r_sampled, r_greedy, update: "Update", ref_lp, reward_metrics,
                     stale: bool = False):
        """The step's metrics. `stale`: the batch was generated by an older policy version (separate placement),
        so the engine-vs-actor gap holds the policy's change too and is not warned about (the behaviour gap
        is, when computed)."""
        stats, old_lp, adv = update.stats, update.logprobs, update.advantages
        mask = batch["response_mask"].bool()
        # Token statistics live on the last stage: reduce there, then broadcast to every stage.
        keys = ("adv_sum", "adv_sq", "adv_n", "kl_sum", "gap_max", "gap_sum", "gap_below")
        local = None
        if self.groups.is_last_stage:
            a = adv[mask].double()
            kl = (old_lp - ref_lp)[mask].double().sum() if ref_lp is not None else 0.0
            gap = logprob_mismatch(old_lp, batch["engine_logprobs"], mask,
                                   threshold=None if stale else self.cfg.rollout.logprob_warn_threshold,
                                   constrained=SamplingParams.from_config(self.cfg.rollout).guided is not None)
            local = dict(adv_sum=a.sum(), adv_sq=a.pow(2).sum(), adv_n=a.numel(), kl_sum=kl, gap_max=gap["max"],
                         gap_sum=gap["mean"] * a.numel(), gap_below=gap["below"])
        totals = reduce_totals(self._from_last_stage(local, keys), self._dp_group, maximum=("gap_max", "gap_below"))
        n_tok = max(totals["adv_n"], 1.0)
        adv_mean = totals["adv_sum"] / n_tok
        lengths = [len(c.token_ids) for r in rollouts for c in r.sampled]
        n = self.cfg.rollout.n
        # For health.py: how many samples tie with their greedy reward (advantage 0: no signal), are the
        # greedy response itself, and the rewards' range.
        ties = [float(r == r_greedy[i // n]) for i, r in enumerate(r_sampled)]
        same = [float(c.token_ids == r.greedy.token_ids) for r in rollouts for c in r.sampled]
        every = r_sampled + r_greedy
        extremes = reduce_totals({"max": max(every), "neg_min": -min(every)}, self._dp_group,
                                 maximum=("max", "neg_min"))
        record = {
            "step": self.step + 1,
            "reward/sampled_mean": self._dp_mean(r_sampled),
            "reward/greedy_mean": self._dp_mean(r_greedy),
            "advantage/mean": adv_mean,
            "advantage/std": math.sqrt(max(totals["adv_sq"] / n_tok - adv_mean ** 2, 0.0)),
            "kl/mean": totals["kl_sum"] / n_tok,
            "loss": stats["loss"], "pg_loss": stats["pg_loss"], "entropy/mean": stats["entropy"],
            "clip_frac": stats["clip_frac"], "grad_norm": stats["grad_norm"],
            "response/length_mean": self._dp_mean(lengths),
            "response/clipped_frac": self._dp_mean([float(c.finish_reason == "length")
                                                    for r in rollouts for c in r.sampled]),
            "logprob/engine_vs_actor_max_diff": totals["gap_max"],
            "logprob/engine_vs_actor_mean_diff": totals["gap_sum"] / n_tok,
            # how far the engine's log-probs fall below the actor's (under guided decoding, the one that counts)
            "logprob/engine_below_actor_max_diff": totals["gap_below"],
            "reward/tie_frac": self._dp_mean(ties), "rollout/same_as_greedy_frac": self._dp_mean(same),
            "reward/min": -extremes["neg_min"], "reward/max": extremes["max"],
        }
        record.update({k: stats[k] for k in MOE_STATS + REPLAY_STATS if k in stats})
        record.update(self._global_reward_metrics(reward_metrics))
        record.update(self._correction_record(batch, old_lp))
        return record

    def _correction_record(self, batch: dict, behaviour: torch.Tensor | None) -> dict:
        """is/* metrics of algo.rollout_correction over the step's batch (every DP rank's), from the rollout
        policy's log-probs `behaviour` [B, S] (last stage; None elsewhere) and the engine's: the same weights
        the loss used. {} when the correction is off."""
        mode = self.cfg.algo.rollout_correction
        if mode == "none":
            return {}
        local = None
        if self.groups.is_last_stage:
            _, local = correction_weights(behaviour, batch["engine_logprobs"], batch["response_mask"], mode,
                                          self.cfg.algo.rollout_is_cap)
        totals = reduce_totals(self._from_last_stage(local, IS_STAT_KEYS), self._dp_group, maximum=("ratio_max",))
        return correction_metrics(totals, mode)

    def _global_reward_metrics(self, local: dict) -> dict:
        """The scorer's per-rank metrics over the whole batch: `*_mean` weighted by the rank's count of
        scored responses (`reward/unique_scored`, which is summed), anything else summed."""
        return count_weighted(local, "reward/unique_scored", self._dp_group)

    # ---- eval ----------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy decoding on the held-out prompts: the mean reward (eval/reward_mean), each reward
        function's and the reward model's (eval/reward/<fn>_mean), and a few samples printed."""
        parts = self.parts
        selected = parts.eval_prompts[: self.cfg.trainer.eval_prompts]
        if len(selected) < self.groups.dp_size:  # the same decision on every rank: no DP rank waits for another
            return {}
        prompts = self._local_share(selected)
        self._sync()
        with self.offload.offloaded():
            rollouts = self._generate(prompts, 0)
        responses = [[(r.greedy.token_ids, self._decode(r.greedy.token_ids))] for r in rollouts]
        scores, metrics = parts.scorer.score(prompts, responses)
        rewards = [row[0] for row in scores]
        self._print_samples(prompts, [resp[1] for (resp,) in responses], rewards)
        record = {"step": self.step, "eval/reward_mean": self._dp_mean(rewards)}
        record.update({f"eval/{k}": v for k, v in self._global_reward_metrics(metrics).items()
                       if k != "reward/unique_scored"})
        return record

    def _print_samples(self, prompts: list[Prompt], responses: list[str], rewards: list[float]) -> None:
        """logging.sample_completions eval samples with their reference answer and reward. Each eval shows
        the next ones of the evaluated set (rotating with the step, so a resumed run shows the same), from
        whichever DP rank decoded them."""
        count = self.cfg.logging.sample_completions
        total = len(prompts) * self.groups.dp_size  # the evaluated prompts, every DP rank's share in order
        if not count or not total:
            return
        every = max(self.cfg.trainer.eval_every, 1)
        shown = {(self.step // every * count + j) % total for j in range(min(count, total))}
        first = self.groups.dp_rank * len(prompts)
        lines = []
        for i, (q, response, reward) in enumerate(zip(prompts, responses, rewards)):
            if first + i in shown:
                question = q.raw[-1]["content"] if q.is_chat else q.raw or q.text
                answer = f"answer {_clipped(q.columns['answer'])}, " if q.columns.get("answer") is not None else ""
                lines.append((first + i, f"  [eval step {self.step}] {_clipped(question)} -> {_clipped(response)}  "
                                         f"({answer}reward {reward:.4g})"))
        if self.groups.dp_size > 1:
            everyone: list = [None] * self.groups.dp_size
            dist.all_gather_object(everyone, lines, group=self.groups.dp)
            lines = [line for rank_lines in everyone for line in rank_lines]
        for _, line in sorted(lines):
            self.log.write(line)

    # ---- checkpoints and preemption ----------------------------------------------------------
    def state_dict(self) -> dict:
        return {"sampler": self._sampler_state(), "scheduler": self.parts.scheduler.state_dict(),
                "kl": self.parts.kl.state_dict(), "skipped_updates": self.skipped_updates,
                "model": self._model_fingerprint}

    @functools.cached_property
    def _model_fingerprint(self) -> dict:
        """Which model this run trains (resume.check_resume compares it at resume)."""
        return model_fingerprint(self.cfg.actor.model, self.parts.hf_dir, self.parts.tokenizer)

    def save(self) -> str:
        c = self.cfg.checkpoint
        start = time.perf_counter()
        path = save_checkpoint(c.dir, self.step, self.actor_module, self.parts.optimizer, self.state_dict(),
                               self.parts.hf_dir, keep=c.keep)
        self._save_seconds = time.perf_counter() - start
        self.log.write(f"saved checkpoint {path}")
        return path

    def export_hf(self) -> str:
        """The actor as a Hugging Face directory, <output_dir>/hf/step_N (checkpoint.hf_every): the converter's
        export (weights/export.save_hf_dir), written by rank 0; the last checkpoint.keep are kept."""
        root = os.path.join(self.cfg.trainer.output_dir, "hf")
        path = os.path.join(root, step_dir_name(self.step))
        writer = dist.get_rank() == 0
        save_hf_dir(self.actor_module, path, self.parts.hf_dir, tool="remax_megatron.train", writer=writer,
                    overwrite=True, groups=self.groups)
        if writer:
            exports = sorted(name for name in os.listdir(root) if STEP_DIR.match(name))
            for old in exports[: max(0, len(exports) - self.cfg.checkpoint.keep)]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        self.log.write(f"exported Hugging Face model {path}")
        return path

    def resume(self, path: str) -> None:
        """Collective: continue from checkpoint `path` (the same on every rank: startup.claim_run)."""
        state = load_checkpoint(path, self.actor_module, self.parts.optimizer)
        self.step = state["step"]
        self.parts.sampler.load_state_dict(state["sampler"])
        # The update count from the checkpoint, the schedule and Adam's hyperparameters from this config.
        changes = restore_config_hyperparameters(self.parts.optimizer, self.cfg.optim) + \
            schedule_changes(state["scheduler"], self.parts.scheduler)
        self.parts.scheduler.load_state_dict(state["scheduler"])
        self.parts.kl.load_state_dict(state["kl"])
        self.skipped_updates = state["skipped_updates"]
        print0(f"resumed from {path} at step {self.step}")
        if changes:
            print0(f"resume: following this run's config, not the checkpoint's: {'; '.join(changes)}; "
                   f"lr {self.parts.optimizer.param_groups[0]['lr']:.6g} at update {self.parts.scheduler.num_steps}")

    def _stop_requested(self) -> bool:
        """True on every rank when any rank received a stop signal (all stop after the same step).
        The signal's number travels with the flag, so every rank can name it (rank 0 prints)."""
        flag = torch.tensor([self.preempt.signum], dtype=torch.int32)
        signum = int(all_reduce_cpu(flag, op=dist.ReduceOp.MAX).item())
        if signum and not self.preempt.requested:
            self.preempt.signal_name = signal.Signals(signum).name
        return bool(signum)

    def _save_refused(self) -> str | None:
        """Collective: why a stop-signal save would be killed half-way (plain torchrun's grace), or
        None; one decision for all ranks, from the slowest rank's last save."""
        seconds = float(all_reduce_cpu(torch.tensor([self._save_seconds], dtype=torch.float64),
                                       op=dist.ReduceOp.MAX).item())
        why = preemption_save_refusal(self.preempt.signal_name, seconds)
        refused = all_reduce_cpu(torch.tensor([int(why is not None)], dtype=torch.int32), op=dist.ReduceOp.MAX)
        if refused.item():
            return why or "not saving: another rank's launcher would kill the save half-way"
        return None

    # ---- the loop ------------------------------------------------------------------------
    def fit(self, resume: str | None = None) -> bool:
        """Train up to trainer.steps, first resuming checkpoint `resume` when given; returns False when
        stopped early by a preemption signal."""
        cfg = self.cfg
        if resume is not None:
            with self._stage("resume", {}, step=0):
                self.resume(resume)
        if cfg.trainer.eval_every and self.step == 0:
            with self._stage("eval", {}, step=0):
                record = self.evaluate()
            if record:  # no held-out prompts (data.eval_size=0): nothing to log
                self.log.log(record)
        while self.step < cfg.trainer.steps:
            record = self.train_step()
            self.step += 1
            if cfg.trainer.eval_every and (self.step % cfg.trainer.eval_every == 0 or self.step == cfg.trainer.steps):
                with self._stage("eval", {}, step=self.step):
                    record.update({k: v for k, v in self.evaluate().items() if k != "step"})
            self.log.log(record)
            self.log.progress(self.step, record)
            for line in self.health.observe(record):  # the same records, so the same findings, on every rank
                self.log.warn(line)
            # The stop decision and the save are collective: a peer that dies here is one line too.
            with self._stage("checkpoint", {}, step=self.step):
                if self._stop_requested():
                    refusal = self._save_refused()
                    if refusal:
                        print0(f"preempted ({self.preempt.signal_name}): stopped after step {self.step}, {refusal}; "
                               "rerun with checkpoint.resume=auto to continue from the newest checkpoint")
                        return False
                    path = self._save_if_sound()
                    print0(f"preempted ({self.preempt.signal_name}): stopped after step {self.step}, "
                           f"{f'checkpoint {path}' if path else 'not saved'}; rerun with checkpoint.resume=auto to "
                           "continue")
                    return False
                every = cfg.checkpoint.save_every
                if (every and self.step % every == 0) or self.step == cfg.trainer.steps:
                    self._save_if_sound()
                every = cfg.checkpoint.hf_every
                if every and (self.step % every == 0 or self.step == cfg.trainer.steps) \
                        and self.health.save_refusal() is None:  # no export of a collapsed policy either
                    self.export_hf()
        return True

    def _save_if_sound(self) -> str | None:
        """Collective: save, unless this state must not replace the last good checkpoint (health.py's
        findings, or weights that are no longer finite); then say so and keep it. Returns the path."""
        why = self.health.save_refusal()
        local = any(not bool(torch.isfinite(p).all()) for p in self.actor_module.parameters())
        if all_reduce_cpu(torch.tensor([int(local)], dtype=torch.int32), op=dist.ReduceOp.MAX).item():
            why = "the actor's weights hold NaN or inf"
        if why:
            latest = latest_checkpoint(self.cfg.checkpoint.dir)
            self.log.warn(f"warning: not saving step {self.step}: {why}; the newest checkpoint stays "
                          f"{latest or 'none (nothing was saved yet)'}")
            return None
        return self.save()


@dataclass
class Update:
    """What `_train_on` hands to the metrics: summed loss statistics (every rank) and, on the last
    stage, the rollout policy's log-probs and the advantages [B, S] (None on other stages)."""

    stats: dict
    logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    computed_tokens: float = 0.0  # tokens the training forward ran, padding included, over DP


class StageError(RuntimeError):
    """A stage of the step failed (a peer died, a collective timed out): names the step and stage."""


def _swap_data(params: list, tensors: list) -> None:
    """Exchange each parameter's data with tensors[i] (no copy); a second call restores both."""
    for i, p in enumerate(params):
        p.data, tensors[i] = tensors[i], p.data


def _distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (a tensor listed twice counts once: CpuAdamW's state
    also names its fp32 main weights after a checkpoint save)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _clipped(value, limit: int = 200) -> str:
    """repr of a value for a console line, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _share(count: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when `count` items are split into `parts` contiguous, near-equal parts."""
    base, extra = divmod(count, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def _scatter(outputs: list[torch.Tensor], micro: list[MicroBatch], shape) -> torch.Tensor:
    """Per-micro-batch values [b, w] (in `micro`'s order; ghosts' dropped) -> [B, S] on the CPU, 0 elsewhere."""
    width = shape[1]
    # One transfer to the host, not a synchronisation per micro-batch.
    rows = torch.cat([torch.nn.functional.pad(v.float(), (0, width - v.shape[1])) for v in outputs]).cpu()
    out, at = torch.zeros(shape, dtype=torch.float32), 0
    for m in micro:
        count = max(len(m.rows), 1)  # a ghost ran one row
        if not m.ghost:
            out[torch.tensor(m.rows)] = rows[at:at + count]
        at += count
    return out


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
