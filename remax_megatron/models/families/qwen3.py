"""Qwen3 (dense): Llama-shaped without biases, plus an RMSNorm over each head's queries and keys
(`self_attn.q_norm` / `k_norm` -> megatron's `q_layernorm` / `k_layernorm`), and a `head_dim` of its
own that need not be hidden_size / heads (Qwen3-4B and larger: 128 with hidden 2560 / 32 heads)."""

from remax_megatron.models.families.base import CAUSAL_LM, REWARD, Family, layer_windows_of


class Qwen3(Family):
    name = "qwen3"
    architectures = {"Qwen3ForCausalLM": CAUSAL_LM, "Qwen3ForSequenceClassification": REWARD}
    hf_config_class = "Qwen3Config"

    def features(self, cfg, path: str) -> dict:
        super().features(cfg, path)  # attention_bias refused
        return {"qk_layernorm": True, "layer_windows": layer_windows_of(cfg)}

    def tiny_config(self, common: dict, head_dim: int | None = None, **options):
        config = super().tiny_config(common, **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        return config


FAMILY = Qwen3()
