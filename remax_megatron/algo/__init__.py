"""ReMax algorithm pieces: KL estimators and loss aggregation. The advantage and
loss functions that use them live in ``remax_megatron.kernels`` (fused compute)."""

from remax_megatron.algo.aggregation import AGG_MODES, aggregate
from remax_megatron.algo.kl import KL_ESTIMATORS, kl_estimate

__all__ = ["AGG_MODES", "KL_ESTIMATORS", "aggregate", "kl_estimate"]
