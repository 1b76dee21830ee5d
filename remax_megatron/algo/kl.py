"""KL estimators between the actor and the frozen reference, per token.

With ``d = logprobs - ref_logprobs`` (log pi(y) - log pi_ref(y) of the sampled
token, so these are Monte-Carlo estimates of KL(pi || pi_ref), Schulman 2020):

    k1 = d                                   unbiased, can be negative
    k2 = 0.5 * d^2                           biased, low variance, >= 0
    k3 = exp(-d) - (-d) - 1 = exp(r) - r - 1 with r = ref - logp
                                             unbiased, >= 0

All three are differentiable w.r.t. ``logprobs``. For k3 the log-ratio is
clamped to ``[-K3_CLAMP, K3_CLAMP]`` so a token the reference finds very
unlikely cannot overflow the exp; inside that range the formula is exact.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLAMP = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: unknown value {kind!r}; use one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs: shape {tuple(ref_logprobs.shape)} must equal logprobs {tuple(logprobs.shape)}")
    d = logprobs - ref_logprobs.to(logprobs.dtype)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    r = torch.clamp(-d, -K3_CLAMP, K3_CLAMP)
    return torch.exp(r) - r - 1.0
