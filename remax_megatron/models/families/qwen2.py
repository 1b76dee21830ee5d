"""Qwen2 / Qwen2.5: Llama-shaped with biases on q, k and v (never on o_proj)."""

from remax_megatron.models.families.base import CAUSAL_LM, REWARD, Family, layer_windows_of


class Qwen2(Family):
    name = "qwen2"
    architectures = {"Qwen2ForCausalLM": CAUSAL_LM, "Qwen2ForSequenceClassification": REWARD}
    hf_config_class = "Qwen2Config"

    def features(self, cfg, path: str) -> dict:  # noqa: ARG002 - Family.features' signature
        # attention_bias is not a Qwen2 setting: its q/k/v always carry biases.
        return {"qkv_bias": True, "layer_windows": layer_windows_of(cfg)}

    def tiny_config(self, common: dict, sliding_window: int | None = None, max_window_layers: int = 0, **options):
        """sliding_window: the layers from `max_window_layers` on slide (Qwen2's use_sliding_window)."""
        if sliding_window:
            common = dict(
                common, use_sliding_window=True, sliding_window=sliding_window, max_window_layers=max_window_layers
            )
        return super().tiny_config(common, **options)


FAMILY = Qwen2()
