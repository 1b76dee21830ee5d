"""Is the run learning, and is its state worth a checkpoint? Every step's record is watched; each
finding is said once, on stderr.

    health = TrainingHealth(cfg, vocab_size)
    for line in health.observe(record):     # after each step
        print(line, file=sys.stderr)
    why = health.save_refusal()              # None, or why this state must not become a checkpoint

- No learning signal. ReMax learns from r(sample) - r(greedy): when every sampled response got its
  prompt's greedy reward for `trainer.no_signal_steps` steps in a row, every advantage is 0 (KL
  aside), and the loss and gradient with it. The warning names the likely cause from the config and
  the records: sampling that is greedy (rollout.top_k=1, a temperature near 0), samples identical
  to the greedy responses, a reward that never varies (always 0: it never fires), or a policy that
  has converged on these prompts.
- Collapse. An entropy at the uniform bound (>= 95% of ln vocab) after it was below it: the policy
  lost what it knew (e.g. optim.lr far too high; it samples noise, rewards drop to 0). Warned, and
  no checkpoint is written while it lasts: the last good one stays the newest (`save_refusal`).
- Exploding update. A grad norm over 10x the largest of the last 20 finite ones: warned.
- A NaN/inf loss or grad norm needs nothing here: the optimizer skips that update (counted in
  optim/skipped_updates, printed), so the weights stay the last finite ones and may be saved; the
  trainer refuses a save of non-finite weights by itself (RunControl.save_if_sound).
"""

from __future__ import annotations

import math
from collections import deque

UNIFORM_FRACTION = 0.95  # entropy >= this * ln(vocab): the policy is (nearly) uniform
EXPLODING_FACTOR = 10.0  # grad norm > this * the largest recent one
GRAD_WINDOW = 20  # recent finite grad norms kept
GRAD_HISTORY_MIN = 3  # norms needed before judging
NEAR_GREEDY_TEMPERATURE = 0.05


class TrainingHealth:
    def __init__(self, cfg, vocab_size: int):
        self.cfg = cfg
        self.bound = math.log(vocab_size)  # entropy of the uniform distribution (nats)
        self.tie_steps: list[dict] = []  # the current run of steps without a learning signal
        self.grad_norms: deque[float] = deque(maxlen=GRAD_WINDOW)
        self.entropy_was_below = False
        self.collapsed_at: dict | None = None  # the record of the step that is (still) collapsed
        self.warned: set[str] = set()

    def observe(self, record: dict) -> list[str]:
        """The warnings this step's record raises, each kind once per run (every check runs every step:
        each keeps its own history)."""
        found = {"signal": self._no_signal(record), "collapse": self._collapse(record), "grad": self._exploding(record)}
        out = []
        for kind, line in found.items():
            if line and kind not in self.warned:
                self.warned.add(kind)
                out.append(f"warning: {line}")
        return out

    def _no_signal(self, record: dict) -> str | None:
        steps = self.cfg.trainer.no_signal_steps
        if record["reward/tie_frac"] < 1.0:
            self.tie_steps = []
            return None
        self.tie_steps = (self.tie_steps + [record])[-max(steps, 1) :]
        if not steps or len(self.tie_steps) < steps:
            return None
        first = self.tie_steps[-steps]["step"]
        return (
            f"no learning signal for {steps} steps (steps {first}-{record['step']}): every sampled response got "
            "its prompt's greedy reward, so every advantage is 0 and nothing is learned; likely cause: "
            f"{self._no_signal_cause(self.tie_steps[-steps:])}"
        )

    def _no_signal_cause(self, records: list[dict]) -> str:
        r = self.cfg.rollout
        causes = []
        if r.top_k == 1:
            causes.append("rollout.top_k=1 makes sampling greedy decoding (use 0, off, or a larger k)")
        if r.temperature <= NEAR_GREEDY_TEMPERATURE:
            causes.append(f"rollout.temperature={r.temperature} is so low that sampling is greedy decoding")
        if not causes and all(rec["rollout/same_as_greedy_frac"] >= 1.0 for rec in records):
            causes.append(
                "every sampled response equals its greedy one (a policy this sharp, or rollout.top_p="
                f"{r.top_p} / rollout.temperature={r.temperature} that leave one candidate)"
            )
        if causes:  # sampling is greedy: whatever the reward, samples and greedy responses score alike
            return "; ".join(causes)
        low = min(rec["reward/min"] for rec in records)
        high = max(rec["reward/max"] for rec in records)
        if low == high:
            what = "never fires" if low == 0 else "never varies"
            return (
                f"every reward was {low:g}: the reward {what} (check reward.functions and the data's "
                f"'{self.cfg.data.answer_key}' column, data.answer_key)"
            )
        return (
            "the samples differ but score like their greedy ones: a reward too coarse to tell them apart, or the "
            "policy has converged on these prompts"
        )

    def _collapse(self, record: dict) -> str | None:
        entropy = record["entropy/mean"]
        at_bound = entropy >= UNIFORM_FRACTION * self.bound
        if not at_bound:
            self.entropy_was_below, self.collapsed_at = True, None
            return None
        if not self.entropy_was_below:  # it started there (an untrained model): nothing collapsed
            return None
        self.collapsed_at = self.collapsed_at or record
        return (
            f"the policy collapsed to uniform at step {self.collapsed_at['step']}: entropy {entropy:.3f}, the "
            f"uniform bound is ln(vocab) = {self.bound:.3f}, rewards {record['reward/sampled_mean']:.3g}; the "
            "update diverged (optim.lr too high?); no checkpoint is written while it lasts"
        )

    def _exploding(self, record: dict) -> str | None:
        norm = record["grad_norm"]
        if not math.isfinite(norm):
            return None  # a skipped update: counted and printed by the trainer
        recent = max(self.grad_norms, default=0.0)
        exploding = len(self.grad_norms) >= GRAD_HISTORY_MIN and recent > 0 and norm > EXPLODING_FACTOR * recent
        self.grad_norms.append(norm)
        if not exploding:
            return None
        return (
            f"grad norm {norm:.4g} at step {record['step']} is over {EXPLODING_FACTOR:g}x the largest of the "
            f"{len(self.grad_norms) - 1} updates before ({recent:.4g}): the update may be diverging; lower "
            "optim.lr, or optim.grad_clip"
        )

    def save_refusal(self) -> str | None:
        """Why the current state must not be checkpointed (None: it may)."""
        if self.collapsed_at is not None:
            return (
                f"the policy has been collapsed to uniform since step {self.collapsed_at['step']} "
                f"(entropy at ln(vocab) = {self.bound:.3f})"
            )
        return None
