"""KL coefficient controllers: fixed, or adaptive towards a target KL (Ziegler et al., 2019).

Adaptive rule, per update with `n` sequences and measured per-sequence KL `kl`:
    error = clip(kl / target - 1, -0.2, 0.2);   coef <- coef * (1 + error * n / horizon)
"""

from __future__ import annotations


class KLController:
    def __init__(self, init_coef: float, target: float = 0.0, horizon: int = 10000):
        if init_coef < 0:
            raise ValueError(f"kl coefficient {init_coef} must be >= 0")
        self.coef, self.target, self.horizon = float(init_coef), float(target), int(horizon)

    @property
    def adaptive(self) -> bool:
        return self.target > 0

    def update(self, kl: float, n_sequences: int) -> float:
        """Feed the measured per-sequence KL of an update; returns the new coefficient."""
        if self.adaptive:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n_sequences / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
