"""DeepSeek-V3 / R1 (`deepseek_v3`, DeepseekV3ForCausalLM): multi-latent attention (mla.py: q through a
low-rank latent, or one q projection when `q_lora_rank` is null as in DeepSeek-V2-Lite's layout; keys and
values through one shared latent; a per-head rope part; YaRN) and DeepSeek-style MoE (deepseek_moe.py:
`first_k_dense_replace` dense layers, then sigmoid routing with the frozen fp32 correction bias, group-limited
top-k over `n_group` / `topk_group`, `routed_scaling_factor` and shared experts).

megatron side: MLATransformerConfig (hf_config.transformer_config) and megatron-core's local layer spec with
`multi_latent_attention=True`, whose core attention is models/attention.py's TorchDotProductAttention
(gpt.layer_spec); the TE spec is never used for it.

Refused in one line before any work (the files that compute them say why): `norm_topk_prob: false`, a top-1
router, group scoring megatron does not share with transformers (top_k / topk_group != 2), a softmax router,
attention biases, `rope_interleave: false`, rope types other than YaRN / default, `hidden_act` other than silu.
Multi-token-prediction layers (`num_nextn_predict_layers`) are skipped on import and not exported, each
with one console line (deepseek_moe.py).
"""

from __future__ import annotations

from remax_megatron.models.families import deepseek_moe, mla
from remax_megatron.models.families.base import CAUSAL_LM


class DeepseekV3(deepseek_moe.DeepseekMoeFamily):
    name = "deepseek_v3"
    architectures = {"DeepseekV3ForCausalLM": CAUSAL_LM}
    hf_config_class = "DeepseekV3Config"

    def features(self, cfg, path: str) -> dict:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} in {path} is not supported: DeepSeek-V3's MLPs use 'silu'")
        return {**mla.mla_features(cfg, path), **deepseek_moe.moe_features(cfg, path)}

    def layer_rules(self, arch, layer):
        return mla.mla_attention_rules(arch) + deepseek_moe.mlp_rules(arch, layer)

    def tiny_config(
        self,
        common: dict,
        q_lora_rank: int | None = 20,
        kv_lora_rank: int = 18,
        qk_nope_head_dim: int = 10,
        qk_rope_head_dim: int = 6,
        v_head_dim: int = 14,
        experts: int = 4,
        top_k: int = 2,
        moe_ffn: int | None = None,
        shared_experts: int = 1,
        first_dense: int = 1,
        routed_scaling_factor: float = 1.5,
        groups: int = 1,
        group_topk: int = 1,
        yarn: bool = False,
        **options,
    ):
        """Odd MLA widths by default (no power of two): q latent 20 (None: one q projection), kv latent 18, per
        head nope 10 + rope 6, values 14. `intermediate_size` of `common` is the dense layers' width; `moe_ffn`
        each expert's (default half). `yarn`: YaRN RoPE (factor 4 past a quarter of max_positions)."""
        moe_ffn = moe_ffn or max(common["intermediate_size"] // 2, 1)
        common = dict(common, moe_intermediate_size=moe_ffn, num_key_value_heads=common["num_attention_heads"])
        if yarn:
            original = max(common["max_position_embeddings"] // 4, 1)
            common["rope_parameters"] = dict(
                common["rope_parameters"],
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=original,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            )
        config = super().tiny_config(common, **options)
        config.q_lora_rank, config.kv_lora_rank = q_lora_rank, kv_lora_rank
        config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim = (
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        config.qk_head_dim, config.head_dim = qk_nope_head_dim + qk_rope_head_dim, qk_rope_head_dim  # as HF derives
        config.n_routed_experts, config.num_experts_per_tok = experts, top_k
        config.n_shared_experts, config.first_k_dense_replace = shared_experts, first_dense
        config.n_group, config.topk_group = groups, group_topk  # group-limited top-k
        config.norm_topk_prob, config.routed_scaling_factor = True, routed_scaling_factor
        config.rope_interleave, config.attention_bias = True, False
        config.num_nextn_predict_layers = 0
        # what DeepSeek-V3's own config.json says of its router (transformers ignores them; vLLM reads them)
        config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
        return config


FAMILY = DeepseekV3()
