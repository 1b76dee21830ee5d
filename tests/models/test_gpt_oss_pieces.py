"""gpt-oss building blocks against transformers in fp64: the expert layout (gate/up de-interleaved,
transposed) through megatron-core's own MLP with quick_gelu + glu_linear_offset + clamp equals
GptOssExperts; the window off-by-one equals transformers' sliding mask; broken mappings fail."""

import socket

import pytest
import torch
import torch.distributed as dist

from remax_megatron.models.families import gpt_oss

E, HIDDEN, FFN = 3, 12, 10


@pytest.fixture(scope="module")
def megatron_one_rank():
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _hf_experts(seed=0):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=E)
    experts = GptOssExperts(config).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 2)  # wide: the clamp at 7 acts
    return config, experts


def _megatron_mlp(hf_config: dict, fc1, fc1_bias, fc2, fc2_bias):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=1,
        params_dtype=torch.float64,
        use_cpu_initialization=True,
        **gpt_oss.activation_kwargs(hf_config),
    )
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(fc1)
        mlp.linear_fc1.bias.copy_(fc1_bias)
        mlp.linear_fc2.weight.copy_(fc2)
        mlp.linear_fc2.bias.copy_(fc2_bias)
    return mlp


def _megatron_vs_hf(hf_config: dict, to_megatron=gpt_oss.experts_to_megatron):
    config, experts = _hf_experts()
    x = torch.randn(7, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    fc1, fc1_b, fc2, fc2_b = to_megatron(
        experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias
    )
    gaps = []
    for e in range(E):
        mlp = _megatron_mlp(hf_config, fc1[e], fc1_b[e], fc2[e], fc2_b[e])
        out, bias = mlp(x.unsqueeze(1))  # [s, b, h]
        ours = (out + bias if bias is not None else out).squeeze(1)
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        theirs = experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]
        gaps.append((ours - theirs).abs().max().item())
    return max(gaps)


def test_expert_mlp_matches_transformers_fp64(megatron_one_rank):
    hf = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
    assert _megatron_vs_hf(hf) <= 1e-12


def test_broken_mappings_fail(megatron_one_rank):
    hf = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}

    def interleaved(gu, gub, d, db):  # gate and up not de-interleaved
        return gu.transpose(1, 2).contiguous(), gub, d.transpose(1, 2).contiguous(), db

    assert _megatron_vs_hf(hf, interleaved) > 1e-3
    silu = gpt_oss.activation_kwargs
    try:  # SiLU instead of quick_gelu, and no clamp: both must show
        gpt_oss.activation_kwargs = lambda h: {**silu(h), "activation_func": torch.nn.functional.silu}
        assert _megatron_vs_hf(hf) > 1e-3
        gpt_oss.activation_kwargs = lambda h: {**silu(h), "activation_func_clamp_value": None}
        assert _megatron_vs_hf(hf) > 1e-3
        gpt_oss.activation_kwargs = lambda h: {**silu(h), "glu_linear_offset": 0.0}
        assert _megatron_vs_hf(hf) > 1e-3
    finally:
        gpt_oss.activation_kwargs = silu


def test_experts_round_trip_bitwise():
    _, experts = _hf_experts(seed=2)
    hf = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
    back = gpt_oss.experts_to_hf(*gpt_oss.experts_to_megatron(*hf))
    assert all(torch.equal(a, b) for a, b in zip(back, hf))
    fc1, _, fc2, _ = gpt_oss.experts_to_megatron(*hf)
    assert fc1.shape == (E, 2 * FFN, HIDDEN) and fc2.shape == (E, HIDDEN, FFN)
    assert torch.equal(fc1[:, :FFN], experts.gate_up_proj[..., 0::2].transpose(1, 2))  # gate rows first


def test_window_off_by_one_matches_transformers_mask():
    from transformers.masking_utils import sliding_window_overlay

    hf = {"num_hidden_layers": 3, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 1}
    with pytest.raises(ValueError, match="expected 3 entries"):
        gpt_oss.layer_windows(hf)
    hf["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    windows = gpt_oss.layer_windows(hf)
    assert windows == [(3, 0), None, (3, 0)]
    left, right = windows[0]
    keep_hf = sliding_window_overlay(hf["sliding_window"])
    for q in range(10):
        for k in range(q + 1):  # causal part; megatron keeps q - left <= k <= q + right
            assert bool(keep_hf(0, 0, q, k)) == (q - left <= k <= q + right), (q, k)
    assert gpt_oss.layer_windows({"num_hidden_layers": 4, "sliding_window": 8}) == [(7, 0), None, (7, 0), None]


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="swiglu_alpha=1.5: megatron's quick_gelu is hard-wired to 1.702"):
        gpt_oss.activation_kwargs({"swiglu_alpha": 1.5})
    with pytest.raises(ValueError, match="sliding_window=None with sliding layers"):
        gpt_oss.layer_windows({"num_hidden_layers": 2, "sliding_window": None})


def test_layer_names_cover_transformers_model():
    """Every tensor of a decoder layer of transformers' GptOssForCausalLM has a megatron name, and
    megatron-core's attention with softmax_type='learnable' holds the sink under that name."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_local_experts=E,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        vocab_size=101,
        num_experts_per_tok=2,
    )
    names = GptOssForCausalLM(config).state_dict().keys()
    layer = {n.split(".", 3)[3] for n in names if n.startswith("model.layers.0.")}
    assert layer == set(gpt_oss.LAYER_NAMES)


def test_megatron_sink_is_transformers_sink_fp64(megatron_one_rank, monkeypatch):
    """megatron-core's attention with softmax_type='learnable' holds a [heads] sink under the mapped
    name, and its softmax equals transformers' (the sink appended as one more logit, then dropped)."""
    from megatron.core.fusions.fused_softmax import SoftmaxOne
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    heads = 4
    config = TransformerConfig(
        num_layers=1,
        hidden_size=24,
        num_attention_heads=heads,
        softmax_type="learnable",
        params_dtype=torch.float64,
        use_cpu_initialization=True,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron allocates the sink on cuda
    attention = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    sink_name = gpt_oss.LAYER_NAMES["self_attn.sinks"].split("core_attention.")[1]
    assert dict(attention.named_parameters())[sink_name].shape == (heads,)
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, heads, 5, 7, generator=g, dtype=torch.float64)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(2, -1, 5, 1)], dim=-1)  # transformers' eager
    combined = combined - combined.max(dim=-1, keepdim=True).values
    theirs = torch.softmax(combined, dim=-1)[..., :-1]
    assert (SoftmaxOne(-1, sinks)(scores) - theirs).abs().max().item() <= 1e-15


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(monkeypatch, truncate):
    """gpt-oss's published YaRN (factor 32, truncate false) through megatron-core's YarnRotaryEmbedding:
    the frequencies and the attention scale equal transformers' in float32 (megatron's precision)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": truncate,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    }
    config = GptOssConfig(head_dim=64, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron moves its tables to cuda
    yarn = YarnRotaryEmbedding(64, use_cpu_initialization=True, **gpt_oss.yarn_kwargs({"rope_parameters": rope}))
    emb, mscale = yarn.get_emb(2)
    assert torch.allclose(emb[1, 0, 0, :32], inv_freq.float(), rtol=1e-6, atol=0)
    assert abs(mscale - attention_factor) <= 1e-12
    if not truncate:  # broken on purpose: the rounding gpt-oss turns off moves frequencies
        wrong = YarnRotaryEmbedding(
            64,
            use_cpu_initialization=True,
            **{**gpt_oss.yarn_kwargs({"rope_parameters": rope}), "correction_range_round_to_int": True},
        )
        assert not torch.allclose(wrong.get_emb(2)[0][1, 0, 0, :32], inv_freq.float(), rtol=1e-6, atol=0)
