"""HF config -> megatron TransformerConfig (hf_config), the model families (families), and the actor,
reference and reward-model builders (gpt).

Names are imported on first use: reading a config or a family does not import megatron-core (a few
seconds), so start-up checks and tools that only read configs stay fast.
"""

from remax_megatron.lazy import lazy_exports

_EXPORTS = {
    "ModelArch": "remax_megatron.models.arch",
    "build_policy": "remax_megatron.models.gpt",
    "build_reward_model": "remax_megatron.models.gpt",
    "check_layout": "remax_megatron.models.hf_config",
    "padded_vocab_size": "remax_megatron.models.hf_config",
    "read_hf_config": "remax_megatron.models.hf_config",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
