"""Rewards: rule-based functions (registry, user functions, weighted sum) and a reward-model scorer.

Names are imported on first use: the functions (start-up checks) do not import megatron-core, which
the scorer's reward-model path needs.
"""

import importlib

_EXPORTS = {
    "REGISTRY": "remax_megatron.reward.functions",
    "RewardError": "remax_megatron.reward.functions",
    "RewardFunctions": "remax_megatron.reward.functions",
    "register": "remax_megatron.reward.functions",
    "resolve": "remax_megatron.reward.functions",
    "RewardScorer": "remax_megatron.reward.scoring",
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
