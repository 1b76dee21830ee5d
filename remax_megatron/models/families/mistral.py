"""Mistral (7B v0.1-v0.3, Nemo and Small dense models): Llama-shaped, with an explicit head_dim on the
larger ones and an optional sliding window. The window is refused at start-up when it is shorter than
the run's longest sequence (hf_config.check_run_length): megatron's attention here is full causal, and
with every sequence inside the window the two are the same."""

from remax_megatron.models.families.base import CAUSAL_LM, REWARD, Family, sliding_window_of


class Mistral(Family):
    name = "mistral"
    architectures = {"MistralForCausalLM": CAUSAL_LM, "MistralForSequenceClassification": REWARD}
    hf_config_class = "MistralConfig"

    def features(self, cfg, path: str) -> dict:
        super().features(cfg, path)  # attention_bias refused
        return {"sliding_window": sliding_window_of(cfg)}

    def tiny_config(self, common: dict, head_dim: int | None = None, sliding_window: int | None = None, **options):
        config = super().tiny_config(common, **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        config.sliding_window = sliding_window  # HF's default is 4096; tiny models have none unless asked
        return config


FAMILY = Mistral()
