"""The update: a step's padded batch -> micro-batches -> megatron's schedule -> optimizer steps.

    updater = Updater(cfg, parts, reduce)
    batch, plan = updater.micro_batch_plan(batch)           # this rank's rows and micro-batches per update
    ref = updater.reference_logprobs(batch, plan)           # [B, S] on the last stage; None without KL
    update = updater.train_on(batch, old_logprobs, ref, plan, step=step)

The loss of every optimizer update is normalised by its GLOBAL response-token (sequence) count, summed over
its micro-batches and DP ranks, so how its rows are grouped (micro-batch size, token budget, packing, DP
balance) does not change it (tests/train/test_update.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from remax_megatron.algo.rollout_correction import correction_weights
from remax_megatron.algo.zero_advantage import rows_without_signal, skips_zero_advantage
from remax_megatron.batching import (
    MicroBatch,
    assemble,
    exchange_rows,
    fixed_micro_batches,
    model_inputs,
    model_labels,
    plan_step,
    take_rows,
    to_rows,
    to_sequences,
)
from remax_megatron.kernels import compute_advantages, logprob_gradient, remax_loss
from remax_megatron.metrics import print0
from remax_megatron.models.forward import forward_only, run_schedule, to_model_device
from remax_megatron.models.gpt import sequence_multiple
from remax_megatron.models.lora import adapters_disabled, has_adapters
from remax_megatron.models.moe import LoadBalancing, end_replay, padding_mask, replay_routes
from remax_megatron.step_metrics import LOSS_STATS, MOE_STATS, REPLAY_STATS, DpReduce


@dataclass
class Update:
    """What `Updater.train_on` hands to the metrics: summed loss statistics (every rank) and, on the last
    stage, the rollout policy's log-probs and the advantages [B, S] (None on other stages)."""

    stats: dict
    logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    computed_tokens: float = 0.0  # tokens the training forward ran, padding included, over DP
    skipped_rows: float = 0.0  # rows left out of the forward (trainer.skip_zero_advantage), over DP


class Updater:
    def __init__(self, cfg, parts, reduce: DpReduce):
        self.cfg, self.parts, self.reduce, self.groups = cfg, parts, reduce, reduce.groups
        self.actor_module = model = parts.actor.module
        # MoE: the load-balancing loss and expert-load statistics (hooks on the actor's routers)
        self.balance = (
            LoadBalancing(
                model, cfg.algo.moe_aux_loss, cfg.algo.moe_aux_loss_coef, self.groups.tp, self.groups.dp, self.groups.pp
            )
            if model.arch.is_moe
            else None
        )
        self.skipped_updates = 0
        self.skip_zero_advantage = skips_zero_advantage(cfg, model.arch.is_moe)

    def micro_batch_plan(self, batch: dict) -> tuple[dict, list[list[MicroBatch]]]:
        """This rank's rows and its micro-batches per update (remax_megatron.batching).

        trainer.micro_batch_tokens = 0: the rows stay, micro_batch_size rows per micro-batch, all as wide as
        the batch. Otherwise each update's rows are balanced over DP by tokens (a row carries its reward and
        its prompt's greedy reward) and grouped under the token budget, packed with trainer.pack_sequences;
        every DP rank runs as many micro-batches.

        The returned batch adds per row `update_index` (the update that trains it) and `skipped` (left out
        of the forward: trainer.skip_zero_advantage, algo/zero_advantage.py); skipped rows stay in the batch
        (metrics, the loss's global counts) but join no micro-batch."""
        t = self.cfg.trainer
        rows, width = batch["input_ids"].shape
        per_update = rows // t.mini_batches
        skipped = (
            rows_without_signal(batch["rewards"], batch["baseline"], batch["response_mask"])
            if self.skip_zero_advantage
            else torch.zeros(rows, dtype=torch.bool)
        )
        # A rank whose rows all tie still runs its first one (no gradient: exact): the step's entropy, engine gap
        # and health checks keep a forward to read, where a padding-only micro-batch would cost as much.
        skipped[0] = skipped[0] & ~skipped.all()
        batch = dict(batch, update_index=torch.arange(rows) // per_update, skipped=skipped)
        if not t.micro_batch_tokens:
            plan = [
                fixed_micro_batches(
                    [r for r in range(u * per_update, (u + 1) * per_update) if not skipped[r]],
                    t.micro_batch_size,
                    width,
                )
                for u in range(t.mini_batches)
            ]
            return batch, self._same_count(plan, width) if self.skip_zero_advantage else plan
        shapes = [(batch["lengths"].tolist(), width, skipped.tolist())]  # every DP rank's rows and batch width
        if self.groups.dp_size > 1:
            mine, shapes = shapes[0], [None] * self.groups.dp_size
            dist.all_gather_object(shapes, mine, group=self.groups.dp)
        plan = plan_step(
            [lengths for lengths, _, _ in shapes],
            t.mini_batches,
            t.micro_batch_tokens,
            sequence_multiple(self.actor_module),
            t.pack_sequences,
            skipped_by_rank=[skips for _, _, skips in shapes],
        )
        if self.groups.dp_size == 1:
            return take_rows([batch], plan.sources[0]), plan.updates[0]
        me, widest = self.groups.dp_rank, max(w for _, w, _ in shapes)
        return exchange_rows(batch, plan.sources, me, widest, self.groups.dp), plan.updates[me]

    def _same_count(self, plan: list[list[MicroBatch]], width: int) -> list[list[MicroBatch]]:
        """Fixed-count micro-batches with rows skipped: every DP rank (and so every pipeline stage) runs as
        many micro-batches per update as the busiest rank, at least one; the others run empty "ghost"
        micro-batches (one row of padding, no label), so a rank whose rows all tie still joins every
        collective of the schedule, the gradient sync and the optimizer step."""
        counts = {f"u{u}": float(len(m)) for u, m in enumerate(plan)}
        most = self.reduce.totals(counts, maximum=tuple(counts))
        return [
            m + [MicroBatch([], width) for _ in range(max(1, int(most[f"u{u}"])) - len(m))] for u, m in enumerate(plan)
        ]

    def micro_batches(self, batch: dict, micro: list[MicroBatch], extra: dict | None = None) -> list[dict]:
        """The micro-batches' tensors (batching.assemble)."""
        multiple = sequence_multiple(self.actor_module)
        return [assemble(batch, m, extra, multiple) for m in micro]

    @torch.no_grad()
    def logprobs(self, model, batch: dict, plan: list[list[MicroBatch]]) -> torch.Tensor | None:
        """Per-token log-probs [B, S] of the batch's labels under `model` (last stage; None elsewhere)."""
        temperature = self.cfg.rollout.temperature
        micro = [m for update in plan for m in update]
        out = forward_only(
            model,
            self.micro_batches(batch, micro),
            lambda m, hidden, mb: to_sequences(
                mb, m.token_logprobs(hidden, model_labels(mb), temperature=temperature)[0]
            ),
            inputs=model_inputs,
        )
        return scatter_rows(out, micro, batch["input_ids"].shape) if out else None

    @property
    def has_reference(self) -> bool:
        """KL against a reference: a frozen reference model, or a LoRA actor's own base (adapters off)."""
        return self.parts.reference is not None or (self.cfg.algo.kl_coef > 0 and has_adapters(self.actor_module))

    def reference_logprobs(self, batch: dict, plan: list[list[MicroBatch]]) -> torch.Tensor | None:
        """The KL reference's log-probs [B, S] (last stage); None without KL. A LoRA actor is its own
        reference with its adapters switched off (no second model is built)."""
        if self.parts.reference is not None:
            return self.logprobs(self.parts.reference, batch, plan)
        if not self.has_reference:
            return None
        with adapters_disabled(self.actor_module):
            return self.logprobs(self.actor_module, batch, plan)

    def train_on(
        self, batch, old_logprobs, ref_logprobs, plan: list[list[MicroBatch]] | None = None, step: int = 1
    ) -> Update:
        """One optimizer update per entry of `plan` (its micro-batches; default `micro_batch_plan(batch)`'s)
        over the rollout batch of step `step`.

        The advantages are computed per micro-batch inside the loss (remax_megatron.kernels.compute_advantages:
        per row, so equal to a whole-batch call) from the rollout policy's log-probs: `old_logprobs` when
        given (several mini-batches), else the training forward's own, detached (on-policy: the weights that
        produced the rollout, before this update).
        """
        cfg = self.cfg
        if plan is None:
            batch, plan = self.micro_batch_plan(batch)
        summed = {
            k: 0.0
            for k in LOSS_STATS
            + (MOE_STATS if self.balance else ())
            + (REPLAY_STATS if self.balance and cfg.rollout.routing_replay else ())
        }
        grad_norms, behaviour, advantages, computed = [], [], [], 0
        for u, update in enumerate(plan):
            rows = torch.tensor([r for m in update for r in m.rows], dtype=torch.long)
            # The loss's denominators count the update's skipped rows too (algo/zero_advantage.py).
            counted = torch.cat([rows, _skipped_rows(batch, u)])
            # A sequence counts when it has a response token in the loss (trainer.mask_truncated empties some).
            mask = batch["response_mask"]
            num_tokens, num_seqs, run_tokens, run_seqs = self.reduce.dp_sum(
                torch.tensor(
                    [
                        mask[counted].sum(),
                        mask[counted].any(dim=1).sum(),
                        mask[rows].sum(),
                        mask[rows].any(dim=1).sum(),
                    ],
                    dtype=torch.float64,
                )
            ).tolist()
            micro = self.micro_batches(batch, update, {"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs})
            computed += sum(mb["input_ids"].numel() for mb in micro)
            if self.balance:  # normalised by every token the routers see (prompt and response, no padding)
                self.balance.begin_update(self.reduce.dp_sum(batch["lengths"][rows].sum().double()).item(), num_seqs)
            stats = self._forward_backward(micro, num_tokens, num_seqs, behaviour, advantages)
            # entropy/mean is taken over the rows the forward ran: renormalised from the update's counts to theirs
            token_mean = cfg.algo.loss_agg == "token-mean"
            ran, counted_all = (run_tokens, num_tokens) if token_mean else (run_seqs, num_seqs)
            stats["entropy"] *= counted_all / ran if ran else 0.0
            if self.balance:
                stats.update(self.balance.end_update())
                stats["loss"] += self.balance.total_loss(stats)
            grad_norms.append(self._optimizer_step(step))
            for k in summed:
                summed[k] += stats.get(k, 0.0) / len(plan)
        summed["grad_norm"] = sum(grad_norms) / len(grad_norms)
        last = self.groups.is_last_stage
        micro = [m for update in plan for m in update]
        shape = batch["input_ids"].shape
        # The step's bookkeeping stays on the CPU: one transfer each, not a host sync per micro-batch.
        return Update(
            stats=summed,
            logprobs=scatter_rows(behaviour, micro, shape) if last else None,
            advantages=scatter_rows(advantages, micro, shape) if last else None,
            computed_tokens=self.reduce.global_sum(float(computed)),
            skipped_rows=self.reduce.global_sum(float(batch["skipped"].sum())) if "skipped" in batch else 0.0,
        )

    def _optimizer_step(self, step: int) -> float:
        """The optimizer and schedule step (a non-finite gradient skips the update); the gradient norm."""
        parts = self.parts
        ok, norm = parts.optimizer.step()
        if ok:
            parts.scheduler.step(increment=1)
        else:
            self.skipped_updates += 1
            print0(f"step {step}: skipped an update (grad norm {norm}): the weights stay as they were")
        parts.optimizer.zero_grad()
        return norm

    def _forward_backward(
        self, micro: list[dict], num_tokens: float, num_seqs: float, behaviour: list, advantages: list
    ) -> dict:
        """Megatron's schedule over the micro-batches (gradients accumulate); appends each micro-batch's
        rollout-policy log-probs and advantages [b, w] to `behaviour` / `advantages` (last stage).

        A micro-batch's loss, advantages and log-probs are in the sequence layout (one row per sample); the
        model runs its input rows (remax_megatron.batching: padded rows, or packed ones with their attention
        boundaries), whose per-token values `to_rows` / `to_sequences` move between the two."""
        model = self.actor_module

        def step_fn(data_iterator, ddp_model):
            mb = to_model_device(next(data_iterator), model)
            input_ids, inputs = model_inputs(mb)
            moe = {}
            if self.balance:  # which tokens are padding, and for seq_aux which sequence each token is of
                moe = {"padding_mask": padding_mask(model, input_ids, padding=mb["padding"])}
                self.balance.set_sequences(mb.get("segments"))
            if self.cfg.rollout.routing_replay:  # the engine's experts for these tokens
                replay_routes(model, mb["routed_experts"])
            hidden = ddp_model(input_ids, _positions(input_ids), **inputs, **moe)
            return hidden, lambda output: self._loss(mb, output, num_tokens, num_seqs, behaviour, advantages)

        try:
            outputs = run_schedule(model, step_fn, micro, forward_only=False, wrapped=self.parts.actor)
        finally:
            if self.balance:
                end_replay(model)
        local = (
            {k: sum(float(out[k]) for out in outputs if k in out) for k in LOSS_STATS}
            if self.groups.is_last_stage
            else None
        )
        return self.reduce.totals(self.reduce.from_last_stage(local, LOSS_STATS))

    def _loss(self, mb: dict, output, num_tokens: float, num_seqs: float, behaviour: list, advantages: list):
        """One micro-batch's ReMax loss (last stage): (loss, its response tokens, detached statistics)."""
        cfg, model = self.cfg, self.actor_module
        kl_in_loss, correction = cfg.algo.kl_mode == "loss", cfg.algo.rollout_correction
        old, ref = mb.get("old_logprobs"), mb.get("ref_logprobs")
        kl_in_reward = ref is not None and not kl_in_loss
        agg = dict(loss_agg_mode=cfg.algo.loss_agg, global_num_tokens=num_tokens, global_num_seqs=num_seqs)
        clip = cfg.algo.advantage_clip or None
        # Without a KL in the reward the advantages need no log-probs [b, S].
        adv = (
            None if kl_in_reward else compute_advantages(mb["rewards"], mb["baseline"], mb["response_mask"], clip=clip)
        )
        # On-policy without KL the loss is linear in the log-probs: its gradient is known before the output
        # layer runs, and the fused kernel takes it in its forward pass (no logits recomputed). A rollout
        # correction weighs each token by its own log-prob: not known before.
        hint = (
            logprob_gradient(adv, mb["response_mask"], **agg)
            if old is None and ref is None and correction == "none"
            else None
        )
        logprobs, entropy = model.token_logprobs(
            output,
            model_labels(mb),
            temperature=cfg.rollout.temperature,
            with_entropy=True,
            grad_hint=to_rows(mb, hint) if hint is not None else None,
        )
        logprobs, entropy = to_sequences(mb, logprobs), to_sequences(mb, entropy)  # [b, w]
        rollout_policy = old if old is not None else logprobs.detach()  # [b, S]
        if kl_in_reward:
            adv = compute_advantages(
                mb["rewards"],
                mb["baseline"],
                mb["response_mask"],
                rollout_policy,
                ref,
                kl_coef=self.parts.kl.coef,
                clip=clip,
            )  # [b, S]
        behaviour.append(rollout_policy)  # stays on the device: one copy to the host per update
        advantages.append(adv)
        # algo.rollout_correction: pi_actor_old / pi_engine per token, from the rollout policy's log-probs
        is_weights = (
            None
            if correction == "none"
            else correction_weights(
                rollout_policy, mb["engine_logprobs"], mb["response_mask"], correction, cfg.algo.rollout_is_cap
            )[0]
        )
        loss, stats = remax_loss(
            logprobs,
            adv,
            mb["response_mask"],
            **agg,
            old_logprobs=old if cfg.trainer.mini_batches > 1 else None,
            clip_eps=cfg.algo.clip_ratio,
            ref_logprobs=ref if kl_in_loss else None,
            kl_coef=self.parts.kl.coef,
            kl_estimator=cfg.algo.kl_estimator,
            entropy=entropy,
            is_weights=is_weights,
        )
        # A non-finite loss gives non-finite grads: the optimizer skips that update.
        local_tokens = mb["response_mask"].sum().to(torch.int)
        return loss, local_tokens, {k: v.detach().float() for k, v in stats.items()}


def scatter_rows(outputs: list[torch.Tensor], micro: list[MicroBatch], shape) -> torch.Tensor:
    """Per-micro-batch values [b, w] (in `micro`'s order; ghosts' dropped) -> [B, S] on the CPU, 0 elsewhere."""
    width = shape[1]
    # One transfer to the host, not a synchronisation per micro-batch.
    rows = torch.cat([torch.nn.functional.pad(v.float(), (0, width - v.shape[1])) for v in outputs]).cpu()
    out, at = torch.zeros(shape, dtype=torch.float32), 0
    for m in micro:
        count = max(len(m.rows), 1)  # a ghost ran one row
        if not m.ghost:
            out[torch.tensor(m.rows)] = rows[at : at + count]
        at += count
    return out


def _skipped_rows(batch: dict, update: int) -> torch.Tensor:
    """The rows of update `update` left out of its forward (none when the batch has no `skipped`)."""
    if "skipped" not in batch:
        return torch.zeros(0, dtype=torch.long)
    return ((batch["update_index"] == update) & batch["skipped"]).nonzero().flatten()


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
