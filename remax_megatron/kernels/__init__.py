"""Fused compute for ReMax: per-token log-probs/entropy from hidden states and
the vocab-parallel output weight, advantages, and the policy loss.

Each op has a plain-torch reference with the same signature (the contract and
the CPU path) and a Triton implementation used on CUDA; set
``REMAX_KERNEL_IMPL=torch|triton`` (or pass ``impl=``) to force one.
Triton modules are imported lazily, only when dispatched to.
"""

from remax_megatron.kernels.advantages import compute_advantages, compute_advantages_reference
from remax_megatron.kernels.logprobs import IGNORE_INDEX, fused_logprobs, fused_logprobs_reference
from remax_megatron.kernels.loss import logprob_gradient, remax_loss

__all__ = [
    "IGNORE_INDEX",
    "compute_advantages",
    "compute_advantages_reference",
    "fused_logprobs",
    "fused_logprobs_reference",
    "logprob_gradient",
    "remax_loss",
]
