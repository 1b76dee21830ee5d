"""Rewards: rule-based functions (registry, user functions, weighted sum) and a reward-model scorer."""

from remax_megatron.reward.functions import REGISTRY, RewardError, RewardFunctions, register, resolve
from remax_megatron.reward.scoring import RewardScorer

__all__ = ["REGISTRY", "RewardError", "RewardFunctions", "RewardScorer", "register", "resolve"]
