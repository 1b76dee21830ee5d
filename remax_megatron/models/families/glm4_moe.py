"""GLM-4.5 / GLM-4.6 (-Air) (`glm4_moe`): grouped-query attention with biases on q, k and v
(`attention_bias`; o_proj never has one), partial RoPE (`partial_rotary_factor`: the first half of each
head's dims rotate, megatron's rotary_percent), an optional RMSNorm over each head's queries and keys
(`use_qk_norm`), and DeepSeek-style MoE: `first_k_dense_replace` dense layers, then sigmoid routing with
the correction bias, shared experts and the routed scaling factor (deepseek_moe.py, shared with
DeepSeek-V3). Multi-token-prediction layers are skipped (deepseek_moe.py).
"""

from __future__ import annotations

from remax_megatron.models.families import deepseek_moe
from remax_megatron.models.families.base import CAUSAL_LM, attention_rules


class Glm4Moe(deepseek_moe.DeepseekMoeFamily):
    name = "glm4_moe"
    architectures = {"Glm4MoeForCausalLM": CAUSAL_LM}
    hf_config_class = "Glm4MoeConfig"

    def features(self, cfg, path: str) -> dict:
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        factor = float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if not 0 < factor <= 1 or int(head_dim * factor) % 2:
            raise ValueError(
                f"partial_rotary_factor={factor} in {path} with head_dim={head_dim}: RoPE needs an even number "
                "of rotated dims in (0, head_dim]"
            )
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} in {path} is not supported: GLM-4.5's MLPs use 'silu'")
        return {
            "qkv_bias": bool(getattr(cfg, "attention_bias", False)),
            "qk_layernorm": bool(getattr(cfg, "use_qk_norm", False)),
            "rotary_percent": factor,
            **deepseek_moe.moe_features(cfg, path),
        }

    def layer_rules(self, arch, layer):
        return attention_rules(arch, qkv_bias=arch.qkv_bias, qk_norm=arch.qk_layernorm) + deepseek_moe.mlp_rules(
            arch, layer
        )

    def tiny_config(
        self,
        common: dict,
        head_dim: int | None = None,
        experts: int = 4,
        top_k: int = 2,
        moe_ffn: int | None = None,
        shared_experts: int = 1,
        first_dense: int = 1,
        partial_rotary_factor: float = 0.5,
        qk_norm: bool = False,
        qkv_bias: bool = True,
        routed_scaling_factor: float = 1.0,
        groups: int = 1,
        group_topk: int = 1,
        **options,
    ):
        """`intermediate_size` of `common` is the dense layers' width; `moe_ffn` each expert's (default half)."""
        moe_ffn = moe_ffn or max(common["intermediate_size"] // 2, 1)
        config = super().tiny_config(dict(common, moe_intermediate_size=moe_ffn), **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        config.n_routed_experts, config.num_experts_per_tok = experts, top_k
        config.n_shared_experts, config.first_k_dense_replace = shared_experts, first_dense
        config.n_group, config.topk_group = groups, group_topk  # group-limited top-k
        config.norm_topk_prob, config.routed_scaling_factor = True, routed_scaling_factor
        config.use_qk_norm, config.attention_bias = qk_norm, qkv_bias
        config.rope_parameters = dict(config.rope_parameters or {}, partial_rotary_factor=partial_rotary_factor)
        config.num_nextn_predict_layers = 0
        return config


FAMILY = Glm4Moe()
