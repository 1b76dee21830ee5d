"""Qwen2 / Qwen2.5: Llama-shaped with biases on q, k and v (never on o_proj)."""

from remax_megatron.models.families.base import CAUSAL_LM, REWARD, Family, sliding_window_of


class Qwen2(Family):
    name = "qwen2"
    architectures = {"Qwen2ForCausalLM": CAUSAL_LM, "Qwen2ForSequenceClassification": REWARD}
    hf_config_class = "Qwen2Config"

    def features(self, cfg, path: str) -> dict:  # noqa: ARG002 - Family.features' signature
        # attention_bias is not a Qwen2 setting: its q/k/v always carry biases.
        return {"qkv_bias": True, "sliding_window": sliding_window_of(cfg)}


FAMILY = Qwen2()
