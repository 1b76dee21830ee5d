"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norms) with every MLP routed over
`num_experts` SwiGLU experts, `num_experts_per_tok` per token.

Routing as HF computes it: softmax over all experts' logits, the top k, renormalised over them when
`norm_topk_prob` (the released models) -- megatron's top-k-then-softmax (moe_pre_softmax=False) -- and
kept as they are otherwise (moe_pre_softmax=True). Checked against transformers' logits by test. Dense
layers between the MoE ones (`decoder_sparse_step` > 1, `mlp_only_layers`) are refused.
"""

from remax_megatron.models.families.base import (
    CAUSAL_LM,
    Family,
    MLP_GATE_MOE,
    attention_rules,
    check_routing,
    moe_mlp_rules,
    layer_windows_of,
)


class Qwen3Moe(Family):
    name = "qwen3_moe"
    architectures = {"Qwen3MoeForCausalLM": CAUSAL_LM}
    hf_config_class = "Qwen3MoeConfig"
    moe = MLP_GATE_MOE

    def features(self, cfg, path: str) -> dict:
        super().features(cfg, path)  # attention_bias refused
        if getattr(cfg, "decoder_sparse_step", 1) != 1 or getattr(cfg, "mlp_only_layers", None):
            raise ValueError(
                f"decoder_sparse_step={cfg.decoder_sparse_step}, mlp_only_layers={cfg.mlp_only_layers} "
                f"in {path}: dense layers between the MoE ones are not supported (every layer must be MoE)"
            )
        check_routing(cfg.num_experts_per_tok, cfg.norm_topk_prob, path)
        return {
            "qk_layernorm": True,
            "layer_windows": layer_windows_of(cfg),
            "num_experts": cfg.num_experts,
            "moe_ffn_hidden_size": cfg.moe_intermediate_size,
            "moe_top_k": cfg.num_experts_per_tok,
            "moe_pre_softmax": not cfg.norm_topk_prob,
        }

    def layer_rules(self, arch, layer):  # noqa: ARG002 - Family.layer_rules' signature
        return attention_rules(arch, qkv_bias=False, qk_norm=True) + moe_mlp_rules(arch, self.moe)

    def tiny_config(
        self,
        common: dict,
        head_dim: int | None = None,
        experts: int = 4,
        top_k: int = 2,
        norm_topk_prob: bool = True,
        **options,
    ):
        """`intermediate_size` of `common` becomes each expert's width."""
        config = super().tiny_config(dict(common, moe_intermediate_size=common["intermediate_size"]), **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        config.num_experts, config.num_experts_per_tok, config.norm_topk_prob = experts, top_k, norm_topk_prob
        return config


FAMILY = Qwen3Moe()
