"""Mistral (7B v0.1-v0.3, Nemo and Small dense models): Llama-shaped, with an explicit head_dim on the
larger ones and an optional sliding window (every layer's: megatron's window_size, run by models/attention.py
or Transformer Engine's attention)."""

from remax_megatron.models.families.base import CAUSAL_LM, REWARD, Family, layer_windows_of


class Mistral(Family):
    name = "mistral"
    architectures = {"MistralForCausalLM": CAUSAL_LM, "MistralForSequenceClassification": REWARD}
    hf_config_class = "MistralConfig"

    def features(self, cfg, path: str) -> dict:
        super().features(cfg, path)  # attention_bias refused
        return {"layer_windows": layer_windows_of(cfg)}

    def tiny_config(self, common: dict, head_dim: int | None = None, sliding_window: int | None = None, **options):
        config = super().tiny_config(common, **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        config.sliding_window = sliding_window  # HF's default is 4096; tiny models have none unless asked
        return config


FAMILY = Mistral()
