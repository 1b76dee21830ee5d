"""Rewards: rule-based functions (registry, user functions, weighted sum) and a reward-model scorer."""

from remax_megatron.reward.functions import REGISTRY, RewardFunctions, register, resolve
from remax_megatron.reward.scoring import RewardScorer

__all__ = ["REGISTRY", "RewardFunctions", "RewardScorer", "register", "resolve"]
