"""Run control at step boundaries: checkpoints, Hugging Face exports, resume, and stop signals.

    run = RunControl(cfg, parts, groups, log, health)
    state = run.resume(path)                     # weights, optimizer, sampler, schedule, KL from a checkpoint
    ...
    if not run.after_step(step, state_dict):     # collective: stop signal -> save and stop; periodic saves
        return False

A save never replaces the last good checkpoint with a collapsed or non-finite policy (health.py), and a
stop-signal save that plain torchrun would kill half-way is not started (checkpoint.preemption_save_refusal).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist

from remax_megatron.checkpoint import (
    STEP_DIR,
    latest_checkpoint,
    load_checkpoint,
    preemption_save_refusal,
    save_checkpoint,
    step_dir_name,
)
from remax_megatron.metrics import print0
from remax_megatron.optimizer import restore_config_hyperparameters, schedule_changes
from remax_megatron.parallel import all_reduce_cpu
from remax_megatron.processes import preemption_flag
from remax_megatron.resume import model_fingerprint
from remax_megatron.weights.export import save_hf_dir


class RunControl:
    def __init__(self, cfg, parts, groups, log, health):
        self.cfg, self.parts, self.groups, self.log, self.health = cfg, parts, groups, log, health
        self.actor_module = parts.actor.module
        self.preempt = preemption_flag()
        self._save_seconds = 0.0  # the last save's duration: a stop-signal save must fit torchrun's grace

    @functools.cached_property
    def model_fingerprint(self) -> dict:
        """Which model this run trains (resume.check_resume compares it at resume)."""
        return model_fingerprint(self.cfg.actor.model, self.parts.hf_dir, self.parts.tokenizer)

    def after_step(self, step: int, state_dict) -> bool:
        """Collective, after step `step` was logged: on a stop signal save (if it can finish) and return False;
        else the periodic checkpoint and Hugging Face export. `state_dict()`: the trainer's state to save."""
        cfg = self.cfg
        if self.stop_requested():
            refusal = self.save_refused()
            if refusal:
                print0(
                    f"preempted ({self.preempt.signal_name}): stopped after step {step}, {refusal}; "
                    "rerun with checkpoint.resume=auto to continue from the newest checkpoint"
                )
                return False
            path = self.save_if_sound(step, state_dict)
            print0(
                f"preempted ({self.preempt.signal_name}): stopped after step {step}, "
                f"{f'checkpoint {path}' if path else 'not saved'}; rerun with checkpoint.resume=auto to "
                "continue"
            )
            return False
        every = cfg.checkpoint.save_every
        if (every and step % every == 0) or step == cfg.trainer.steps:
            self.save_if_sound(step, state_dict)
        every = cfg.checkpoint.hf_every
        if (
            every and (step % every == 0 or step == cfg.trainer.steps) and self.health.save_refusal() is None
        ):  # no export of a collapsed policy either
            self.export_hf(step)
        return True

    def save(self, step: int, state: dict) -> str:
        c = self.cfg.checkpoint
        start = time.perf_counter()
        path = save_checkpoint(
            c.dir, step, self.actor_module, self.parts.optimizer, state, self.parts.hf_dir, keep=c.keep
        )
        self._save_seconds = time.perf_counter() - start
        self.log.write(f"saved checkpoint {path} in {self._save_seconds:.1f} s")
        return path

    def save_if_sound(self, step: int, state_dict) -> str | None:
        """Collective: save, unless this state must not replace the last good checkpoint (health.py's
        findings, or weights that are no longer finite); then say so and keep it. Returns the path."""
        why = self.health.save_refusal()
        local = any(not bool(torch.isfinite(p).all()) for p in self.actor_module.parameters())
        if all_reduce_cpu(torch.tensor([int(local)], dtype=torch.int32), op=dist.ReduceOp.MAX).item():
            why = "the actor's weights hold NaN or inf"
        if why:
            latest = latest_checkpoint(self.cfg.checkpoint.dir)
            self.log.warn(
                f"warning: not saving step {step}: {why}; the newest checkpoint stays "
                f"{latest or 'none (nothing was saved yet)'}"
            )
            return None
        return self.save(step, state_dict())

    def export_hf(self, step: int) -> str:
        """The actor as a Hugging Face directory, <output_dir>/hf/step_N (checkpoint.hf_every): the converter's
        export (weights/export.save_hf_dir), written by rank 0; the last checkpoint.keep are kept."""
        root = os.path.join(self.cfg.trainer.output_dir, "hf")
        path = os.path.join(root, step_dir_name(step))
        writer = dist.get_rank() == 0
        save_hf_dir(
            self.actor_module,
            path,
            self.parts.hf_dir,
            tool="remax_megatron.train",
            writer=writer,
            overwrite=True,
            groups=self.groups,
        )
        if writer:
            exports = sorted(name for name in os.listdir(root) if STEP_DIR.match(name))
            for old in exports[: max(0, len(exports) - self.cfg.checkpoint.keep)]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        self.log.write(f"exported Hugging Face model {path}")
        return path

    def resume(self, path: str) -> dict:
        """Collective: load checkpoint `path` (the same on every rank: startup.claim_run) into the actor, the
        optimizer, the sampler, the schedule and the KL controller; returns the checkpoint's trainer state."""
        parts = self.parts
        state = load_checkpoint(path, self.actor_module, parts.optimizer)
        parts.sampler.load_state_dict(state["sampler"])
        # The update count from the checkpoint, the schedule and Adam's hyperparameters from this config.
        changes = restore_config_hyperparameters(parts.optimizer, self.cfg.optim) + schedule_changes(
            state["scheduler"], parts.scheduler
        )
        parts.scheduler.load_state_dict(state["scheduler"])
        parts.kl.load_state_dict(state["kl"])
        print0(f"resumed from {path} at step {state['step']}")
        if changes:
            print0(
                f"resume: following this run's config, not the checkpoint's: {'; '.join(changes)}; "
                f"lr {parts.optimizer.param_groups[0]['lr']:.6g} at update {parts.scheduler.num_steps}"
            )
        return state

    def stop_requested(self) -> bool:
        """True on every rank when any rank received a stop signal (all stop after the same step).
        The signal's number travels with the flag, so every rank can name it (rank 0 prints)."""
        flag = torch.tensor([self.preempt.signum], dtype=torch.int32)
        signum = int(all_reduce_cpu(flag, op=dist.ReduceOp.MAX).item())
        if signum and not self.preempt.requested:
            self.preempt.signal_name = signal.Signals(signum).name
        return bool(signum)

    def save_refused(self) -> str | None:
        """Collective: why a stop-signal save would be killed half-way (plain torchrun's grace), or
        None; one decision for all ranks, from the slowest rank's last save."""
        seconds = float(
            all_reduce_cpu(torch.tensor([self._save_seconds], dtype=torch.float64), op=dist.ReduceOp.MAX).item()
        )
        why = preemption_save_refusal(self.preempt.signal_name, seconds)
        refused = all_reduce_cpu(torch.tensor([int(why is not None)], dtype=torch.int32), op=dist.ReduceOp.MAX)
        if refused.item():
            return why or "not saving: another rank's launcher would kill the save half-way"
        return None
