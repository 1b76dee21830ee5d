"""Multi-latent attention (models/families/mla.py): HF config -> megatron's MLATransformerConfig, HF tensors ->
megatron's MLASelfAttention (local spec), and one layer's output against transformers' DeepseekV3Attention
in fp32, with YaRN, odd head dims and q_lora_rank set or null. The full model's parity (MoE, TP, PP, EP)
is the DeepSeek-V3 family's test."""

import dataclasses

import pytest
import torch

from remax_megatron.models.arch import ModelArch
from remax_megatron.models.families.mla import (
    check_mla_tp,
    mla_attention_rules,
    mla_config_kwargs,
    mla_features,
    patch_mla_for_cpu,
)
from tests._dist import run_distributed

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.9,
    "mscale_all_dim": 0.707,
}


def _hf_config(q_lora_rank, **overrides):
    from transformers import DeepseekV3Config

    # Head dims that are not powers of two: nope 10, rope 6, v 14; latents 18 and 20.
    fields = dict(
        vocab_size=301,
        hidden_size=48,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=18,
        qk_nope_head_dim=10,
        qk_rope_head_dim=6,
        v_head_dim=14,
        max_position_embeddings=64,
        rope_parameters=dict(YARN),
        first_k_dense_replace=1,
        attn_implementation="sdpa",
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def _arch(cfg) -> ModelArch:
    return ModelArch(
        architecture="DeepseekV3ForCausalLM",
        family="deepseek_v3",
        task="causal_lm",
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_parameters["rope_theta"],
        rope_scaling_factor=None,
        tie_word_embeddings=False,
        max_position_embeddings=cfg.max_position_embeddings,
        pad_token_id=None,
        torch_dtype="float32",
        **mla_features(cfg, "config.json"),
    )


def test_features_and_config_fields():
    arch = _arch(_hf_config(20))
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.qk_head_dim, arch.qk_pos_emb_head_dim, arch.v_head_dim) == (
        20,
        18,
        10,
        6,
        14,
    )
    kwargs = mla_config_kwargs(arch)
    assert kwargs["rope_type"] == "yarn" and kwargs["rotary_scaling_factor"] == 4.0
    assert kwargs["original_max_position_embeddings"] == 16
    assert (kwargs["mscale"], kwargs["mscale_all_dim"]) == (0.9, 0.707)
    # transformers ignores mscale without mscale_all_dim: megatron gets 1.0 then
    plain = _arch(_hf_config(20, rope_parameters=dict(YARN, mscale_all_dim=0)))
    assert mla_config_kwargs(plain)["mscale"] == 1.0
    assert mla_config_kwargs(_arch(_hf_config(None, rope_parameters={"rope_type": "default"})))["rope_type"] == "rope"


def test_rules_cover_hf_attention_names():
    """The rules name every tensor of transformers' attention, with its shape (q_lora_rank set and null)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for q_lora in (20, None):
        cfg = _hf_config(q_lora)
        hf = {f"self_attn.{k}": tuple(v.shape) for k, v in DeepseekV3Attention(cfg, 0).state_dict().items()}
        hf["input_layernorm.weight"] = (cfg.hidden_size,)
        rules = {name: shape for r in mla_attention_rules(_arch(cfg)) for name, shape in zip(r.hf, r.shapes)}
        assert rules == hf


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
        ({"rope_parameters": dict(YARN, attention_factor=1.1)}, "attention_factor=1.1"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'linear'"),
    ],
)
def test_refusals_in_one_line(overrides, match):
    with pytest.raises(ValueError, match=match) as e:
        mla_features(_hf_config(20, **overrides), "config.json")
    assert "\n" not in str(e.value)


def test_tp_must_divide_the_latents():
    arch = _arch(_hf_config(20))  # kv_lora + rope = 24, q_lora = 20
    check_mla_tp(arch, 4, "actor.tp")
    with pytest.raises(ValueError, match="actor.tp=5 does not divide kv_lora_rank \\+ qk_rope_head_dim=24"):
        check_mla_tp(arch, 5, "actor.tp")
    with pytest.raises(ValueError, match="actor.tp=8 does not divide q_lora_rank=20"):
        check_mla_tp(dataclasses.replace(arch, kv_lora_rank=10), 8, "actor.tp")


class _CausalSDPA(torch.nn.Module):
    """Test-only core attention taking MLA's k_channels / v_channels: causal softmax(q k^T * scale) v."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, n * v]


def _parity_body(rank, world, q_lora, break_split):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from remax_megatron.models.hf_config import transformer_config

    ps.initialize_model_parallel(1, 1)
    patch_mla_for_cpu()
    torch.manual_seed(0)
    cfg = _hf_config(q_lora)
    arch = _arch(cfg)
    hf = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    config = transformer_config(arch, tp=1, pp=1, init_weights=False)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True).submodules.self_attention
    spec.submodules.core_attention = _CausalSDPA
    mla = MLASelfAttention(config, spec.submodules, layer_number=1).eval()
    hf_state = {f"self_attn.{k}": v for k, v in hf.state_dict().items()}
    params = dict(mla.named_parameters())
    for rule in mla_attention_rules(arch):
        if rule.megatron == "input_layernorm.weight":
            continue
        weight = hf_state[rule.hf[0]]
        if break_split and rule.hf[0] == "self_attn.kv_a_proj_with_mqa.weight":  # rope rows first: no split
            weight = torch.cat([weight[arch.kv_lora_rank :], weight[: arch.kv_lora_rank]])
        with torch.no_grad():
            params[rule.megatron.removeprefix("self_attention.")].copy_(weight)
    b, s = 2, 40  # past original_max_position_embeddings=16: YaRN's interpolated band is used
    x = torch.randn(b, s, cfg.hidden_size)
    positions = torch.arange(s)[None].expand(b, s)
    with torch.no_grad():
        expected, _ = hf(x, DeepseekV3RotaryEmbedding(cfg)(x, positions), attention_mask=None)
        got, _ = mla(x.transpose(0, 1).contiguous(), attention_mask=None)
    gap = (got.transpose(0, 1) - expected).abs().max().item()
    scale = expected.abs().max().item()
    if break_split:
        assert gap > 1e-2 * scale, gap
    else:
        assert gap <= 1e-5 * scale, (gap, scale)
    ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("q_lora, break_split", [(20, False), (None, False), (20, True)])
def test_attention_matches_transformers(q_lora, break_split):
    """fp32, one layer, q_lora_rank set and null; the latent's rope rows read first (rope/nope split
    forgotten) must fail the same comparison."""
    run_distributed(_parity_body, 1, (q_lora, break_split))


def test_tp2_shards_merge_back_bitwise():
    """HF -> TP2 shards (column-parallel projections split on their output rows) -> HF, bitwise, q_lora
    set and null; each shard has the shape the mapping promises (what the planner counts)."""
    from remax_megatron.models import families
    from remax_megatron.models.families.base import Family, dense_mlp_rules
    from remax_megatron.weights.mapping import WeightMapping

    class MlaToy(Family):
        name, architectures = "mla_toy", {"MlaToyForCausalLM": families.CAUSAL_LM}

        def layer_rules(self, arch, layer):
            return mla_attention_rules(arch) + dense_mlp_rules(arch)

    families.register(MlaToy())
    try:
        for q_lora in (20, None):
            arch = dataclasses.replace(_arch(_hf_config(q_lora)), family="mla_toy")
            mapping = WeightMapping(arch, tp=2, pp=1, padded_vocab=512)
            hf = {n: torch.randn(mapping.hf_shape(n)) for s in mapping.specs for n in s.hf}

            def read(name, dim, start, stop, hf=hf):
                return hf[name] if dim is None else hf[name].narrow(dim, start, stop - start)

            for spec in mapping.specs:
                shards = [mapping.load_shard(spec, read, r) for r in (0, 1)]
                assert all(tuple(s.shape) == mapping.shard_shape(s_spec) for s, s_spec in zip(shards, (spec, spec)))
                for name, full in mapping.merge_shards(spec, shards):
                    assert torch.equal(full, hf[name]), name
    finally:
        families.unregister("mla_toy")


def test_planner_kv_cache_of_mla():
    """vLLM and transformers 5's model (the native engine) cache the latent and the shared rope key per layer
    and token (18 + 6), on every TP rank."""
    from types import SimpleNamespace

    from remax_megatron.plan import _kv_cache_per_token

    arch = _arch(_hf_config(20))
    for engine, tp, expected in (("vllm", 1, 24), ("vllm", 3, 24), ("native", 1, 24), ("native", 3, 24)):
        cfg = SimpleNamespace(rollout=SimpleNamespace(engine=engine, tp=tp))
        assert _kv_cache_per_token(cfg, arch) == expected
    dense = dataclasses.replace(arch, kv_lora_rank=0, num_kv_heads=1, head_dim=8)
    assert _kv_cache_per_token(SimpleNamespace(rollout=SimpleNamespace(engine="vllm", tp=1)), dense) == 16
