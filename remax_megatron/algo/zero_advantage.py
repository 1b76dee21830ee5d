"""Rows without a learning signal, and whether the update may leave them out (trainer.skip_zero_advantage).

A ReMax sample whose reward equals its prompt's greedy reward has A = r - r_greedy = 0 at every token, so its
policy-gradient term (-A * logp, or the clipped ratio form, or that times an importance weight) is 0 and
its forward and backward add nothing to the gradient. A row with no response token in the loss (a
truncated sample under trainer.mask_truncated) adds nothing either. The update leaves both kinds out of
its micro-batches while the loss's GLOBAL token and sequence counts still count them, so the update
equals the full one to fp32 rounding (tests/train/test_skip_zero_advantage.py).

A DP rank whose rows all tie still runs its first row (no gradient either), so every step keeps a forward
for the metrics read from it (entropy, the engine-vs-actor gap) and the health checks built on them.

That holds only while nothing else gives those rows a gradient; `skip_blocker` names what does.
"""

from __future__ import annotations

import torch


def skip_blocker(cfg, is_moe: bool) -> str | None:
    """Why leaving zero-advantage rows out would change the update (None: it changes nothing)."""
    algo = cfg.algo
    if algo.kl_coef > 0 or algo.kl_target > 0:
        if algo.kl_mode == "loss":
            return "the KL term in the loss (algo.kl_mode=loss) gives every row a gradient"
        return "the per-token KL penalty in the reward (algo.kl_coef > 0) gives a tied row nonzero advantages"
    if is_moe and algo.moe_aux_loss != "none" and algo.moe_aux_loss_coef > 0:
        return "the MoE load-balancing loss (algo.moe_aux_loss) counts every row's tokens"
    if cfg.actor.lora_dropout > 0:
        return "actor.lora_dropout > 0 draws its masks over the rows that run"
    return None


def skips_zero_advantage(cfg, is_moe: bool) -> bool:
    """trainer.skip_zero_advantage resolved: auto = on exactly when nothing blocks it; on where something
    blocks it is refused (ValueError, one line)."""
    mode, blocker = cfg.trainer.skip_zero_advantage, skip_blocker(cfg, is_moe)
    if mode == "on" and blocker:
        raise ValueError(
            f"trainer.skip_zero_advantage=on would change the update here: {blocker}; use "
            "trainer.skip_zero_advantage=auto (skips only when it changes nothing) or off"
        )
    return mode == "on" or (mode == "auto" and blocker is None)


def skip_start_line(cfg, is_moe: bool) -> str | None:
    """The start-up line when auto turns the skip off (None otherwise)."""
    blocker = skip_blocker(cfg, is_moe)
    if cfg.trainer.skip_zero_advantage == "auto" and blocker:
        return f"trainer.skip_zero_advantage=auto: off, every row is trained: {blocker}"
    return None


def rows_without_signal(rewards: torch.Tensor, baseline: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose loss term is 0 at every token before any forward (reward equal to the greedy
    baseline, exactly; or no response token in the loss). Only valid where `skip_blocker` is None."""
    return (rewards == baseline) | (response_mask.sum(dim=1) == 0)
