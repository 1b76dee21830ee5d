"""HF config -> megatron TransformerConfig; actor, reference and reward-model builders."""

from remax_megatron.models.gpt import build_policy, build_reward_model
from remax_megatron.models.arch import ModelArch
from remax_megatron.models.hf_config import check_layout, padded_vocab_size, read_hf_config

__all__ = ["ModelArch", "build_policy", "build_reward_model", "check_layout", "padded_vocab_size",
           "read_hf_config"]
