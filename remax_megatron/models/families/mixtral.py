"""Mixtral (8x7B, 8x22B): Llama's attention with every MLP routed over `num_local_experts` SwiGLU experts
(HF `block_sparse_moe`: gate `w1`, up `w3`, down `w2`), `num_experts_per_tok` per token.

HF routes by softmax over all experts, the top k, renormalised: the same probabilities as megatron's
top-k-then-softmax (moe_pre_softmax=False; checked against transformers' logits by test). Router jitter
(`router_jitter_noise` > 0, a training-time perturbation) is refused rather than approximated.
"""

from remax_megatron.models.families.base import (
    CAUSAL_LM,
    Family,
    MoeNames,
    attention_rules,
    check_routing,
    moe_mlp_rules,
    layer_windows_of,
)


class Mixtral(Family):
    name = "mixtral"
    architectures = {"MixtralForCausalLM": CAUSAL_LM}
    hf_config_class = "MixtralConfig"
    # the checkpoint's `block_sparse_moe` is `mlp` in transformers 5's model, with the experts fused
    moe = MoeNames(
        router="block_sparse_moe.gate.weight",
        expert="block_sparse_moe.experts.{}.",
        gate="w1.weight",
        up="w3.weight",
        down="w2.weight",
        model_router="mlp.gate",
        model_gate_up="mlp.experts.gate_up_proj",
        model_down="mlp.experts.down_proj",
    )

    def features(self, cfg, path: str) -> dict:
        super().features(cfg, path)  # attention_bias refused
        if getattr(cfg, "router_jitter_noise", 0.0):
            raise ValueError(f"router_jitter_noise={cfg.router_jitter_noise} in {path} is not supported: set it to 0")
        check_routing(cfg.num_experts_per_tok, True, path)
        return {
            "layer_windows": layer_windows_of(cfg),
            "num_experts": cfg.num_local_experts,
            "moe_ffn_hidden_size": cfg.intermediate_size,
            "moe_top_k": cfg.num_experts_per_tok,
            "moe_pre_softmax": False,
        }

    def layer_rules(self, arch, layer):  # noqa: ARG002 - Family.layer_rules' signature
        return attention_rules(arch, qkv_bias=False, qk_norm=False) + moe_mlp_rules(arch, self.moe)

    def tiny_config(
        self,
        common: dict,
        head_dim: int | None = None,
        experts: int = 4,
        top_k: int = 2,
        sliding_window: int | None = None,
        **options,
    ):
        """`intermediate_size` of `common` is each expert's width (Mixtral has no dense MLP); a sliding window
        on every layer when given (HF's default is 4096)."""
        config = super().tiny_config(common, **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        config.num_local_experts, config.num_experts_per_tok = experts, top_k
        config.sliding_window = sliding_window
        return config


FAMILY = Mixtral()
