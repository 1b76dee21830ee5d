"""Rewards: rule-based functions (registry, user functions, weighted sum, worker processes with time limits)
and a reward-model scorer.

Names are imported on first use: the functions (start-up checks) do not import megatron-core, which
the scorer's reward-model path needs.
"""

from remax_megatron.lazy import lazy_exports

_EXPORTS = {
    "REGISTRY": "remax_megatron.reward.functions",
    "RewardError": "remax_megatron.reward.functions",
    "RewardFunctions": "remax_megatron.reward.functions",
    "register": "remax_megatron.reward.functions",
    "resolve": "remax_megatron.reward.functions",
    "RewardScorer": "remax_megatron.reward.scoring",
    "RewardWorkers": "remax_megatron.reward.workers",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
