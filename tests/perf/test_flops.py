"""Model FLOPs (remax_megatron.flops) against torch's FLOP counter on the transformers model."""

import json

import pytest
import torch
from transformers import AutoConfig

from tools.make_tiny_model import make_tiny_model


@pytest.mark.parametrize("family,head_dim", [("qwen2", None), ("llama", 32)])
def test_forward_flops_match_torch_flop_counter(tmp_path, family, head_dim):
    """head_dim 32 with hidden 64 and 4 heads: attention width 128 != hidden."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from remax_megatron.flops import forward_flops
    from remax_megatron.models import read_hf_config

    model_dir = make_tiny_model(
        str(tmp_path / "m"), family, hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, vocab=300, seed=0
    )
    if head_dim:
        with open(f"{model_dir}/config.json") as f:
            config = json.load(f)
        config["head_dim"] = head_dim
        with open(f"{model_dir}/config.json", "w") as f:
            json.dump(config, f)
    arch = read_hf_config(model_dir)
    assert arch.num_heads * arch.head_dim == (4 * head_dim if head_dim else 64)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), attn_implementation="eager").eval()
    total = 0
    for s in (16, 5):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randint(4, 300, (1, s)))
        total += counter.get_total_flops()
        # The eager attention computes the full s x s scores and values (4 s^2 h per layer);
        # model FLOPs count the causal half.
        total -= 2 * arch.num_layers * s * s * arch.num_heads * arch.head_dim
    assert forward_flops(arch, [16, 5]) == total


def test_peak_tflops_override_and_cpu():
    from remax_megatron.flops import peak_tflops

    assert peak_tflops(torch.bfloat16, override=123.0) == 123.0
    if not torch.cuda.is_available():
        assert peak_tflops(torch.bfloat16) is None  # MFU is not reported without a known peak


@pytest.mark.parametrize("q_lora", [20, None])
def test_mla_attention_flops_match_torch_flop_counter(q_lora):
    """One multi-latent attention layer (odd head dims, q latent set and null) against torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from remax_megatron.flops import _attention
    from tests.models.test_mla import _arch, _hf_config

    cfg = _hf_config(q_lora, attn_implementation="eager")
    arch = _arch(cfg)
    attention = DeepseekV3Attention(cfg, 0).eval()
    s = 12
    x = torch.randn(1, s, cfg.hidden_size)
    rope = DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(s)[None])
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        attention(x, rope, attention_mask=None)
    projections, scores = _attention(arch)
    # The eager attention computes the full s x s scores and values: model FLOPs count the causal half.
    assert counter.get_total_flops() == s * projections + 2 * s * s * scores


def test_sliding_window_layers_count_their_window():
    """gpt-oss-style alternating windows: a window at least as long as the run changes nothing; a short
    one counts W s - W^2/2 pairs per sliding layer (4 q FLOPs a pair: scores and values)."""
    import dataclasses

    from remax_megatron.flops import attention_pairs, forward_flops

    arch = _arch(
        architecture="GptOssForCausalLM",
        family="gpt_oss",
        hidden_size=48,
        ffn_hidden_size=40,
        num_layers=4,
        num_heads=4,
        head_dim=12,
        vocab_size=301,
        rope_theta=1.5e5,
    )
    lengths, q = [300, 20], 4 * 12
    full = forward_flops(arch, lengths)
    long_windows = dataclasses.replace(arch, layer_windows=(300, None, 300, None))
    assert forward_flops(long_windows, lengths) == full
    short = dataclasses.replace(arch, layer_windows=(128, None, 128, None))
    saved = 2 * 4 * q * (300 * 300 / 2 - (128 * 300 - 128 * 128 / 2))  # only the 300-token row exceeds W
    assert forward_flops(short, lengths) == pytest.approx(full - saved, rel=1e-12)
    assert attention_pairs(128, 128) == attention_pairs(128, None)  # continuous at s = W
    exact = sum(min(i + 1, 128) for i in range(300))  # the discrete count, for scale: within 0.5%
    assert abs(attention_pairs(300, 128) - exact) / exact < 5e-3


# Hand counts: every matmul written out as 2 * (rows) * (inner) * (cols), independently of flops.py.


def _arch(**overrides):
    import dataclasses

    from remax_megatron.models.arch import ModelArch

    arch = ModelArch(
        architecture="LlamaForCausalLM",
        family="llama",
        task="causal_lm",
        hidden_size=64,
        ffn_hidden_size=96,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=300,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling_factor=None,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        pad_token_id=None,
        torch_dtype="float32",
    )
    return dataclasses.replace(arch, **overrides)


def test_forward_flops_of_a_gqa_model_equal_a_hand_count():
    """hidden 64, 8 query heads / 2 KV heads of 8 dims, SwiGLU ffn 96, 3 layers, vocab 300; rows of 16
    and 5 tokens."""
    from remax_megatron.flops import forward_flops

    q_proj = 2 * 64 * (8 * 8)  # per token: [64] x [64, 64]
    k_proj = 2 * 64 * (2 * 8)  # 2 KV heads: [64] x [64, 16]
    v_proj = 2 * 64 * (2 * 8)
    o_proj = 2 * (8 * 8) * 64
    gate, up, down = 2 * 64 * 96, 2 * 64 * 96, 2 * 96 * 64
    layer_per_token = q_proj + k_proj + v_proj + o_proj + gate + up + down
    assert layer_per_token == 8192 + 2048 + 2048 + 8192 + 3 * 12288
    logits_per_token = 2 * 64 * 300

    def attention(s):  # per layer, causal: s^2 / 2 (query, key) pairs, 8 heads of 8 dims each
        scores = 2 * (s * s / 2) * 8 * 8  # q . k
        values = 2 * (s * s / 2) * 8 * 8  # p @ v
        return scores + values

    hand = sum(s * (3 * layer_per_token + logits_per_token) + 3 * attention(s) for s in (16, 5))
    assert hand == 16 * 210432 + 3 * 128 * 16**2 + 5 * 210432 + 3 * 128 * 5**2 == 4_526_976
    assert forward_flops(_arch(), [16, 5]) == hand


def test_forward_flops_of_a_moe_model_equal_a_hand_count():
    """4 layers, the first dense (ffn 96), then 8 experts of ffn 32, top-2, plus shared experts of total
    width 48; 4 heads of 16 dims (no GQA), vocab 100; one row of 10 tokens. A token pays the router,
    its 2 experts and the shared ones, never the 6 other experts."""
    from remax_megatron.flops import forward_flops

    arch = _arch(
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        vocab_size=100,
        num_experts=8,
        moe_ffn_hidden_size=32,
        moe_top_k=2,
        moe_shared_ffn_hidden_size=48,
        first_dense_layers=1,
    )
    attention_proj = 4 * (2 * 64 * 64)  # q, k, v, o: each [64] x [64, 64] per token
    dense_mlp = 3 * (2 * 64 * 96)  # gate, up, down
    router = 2 * 64 * 8  # [64] x [64, 8 experts]
    experts = 2 * 3 * (2 * 64 * 32)  # 2 chosen experts x (gate, up, down)
    shared = 3 * (2 * 64 * 48)
    moe_mlp = router + experts + shared
    assert moe_mlp == 1024 + 24576 + 18432
    per_token = 4 * attention_proj + 1 * dense_mlp + 3 * moe_mlp + 2 * 64 * 100
    attention = 4 * (2 * (10 * 10 / 2) * 64 + 2 * (10 * 10 / 2) * 64)  # 4 layers, scores + values
    hand = 10 * per_token + attention
    assert hand == 10 * 312832 + 51200
    assert forward_flops(arch, [10]) == hand


def test_packed_rows_count_attention_per_document():
    """Sequences of 9, 5 and 4 tokens packed into rows 9 wide: the second row holds two documents. The
    model attends each document alone (batching/micro_batches.py), so the step's FLOPs (step_metrics:
    forward_flops over the sequences' lengths) count 5^2 + 4^2 pairs there, not that row's 9^2, and
    no padding tokens."""
    from remax_megatron.batching.micro_batches import plan_step
    from remax_megatron.flops import forward_flops

    lengths = [9, 5, 4]
    plan = plan_step([lengths], mini_batches=1, budget=18, pack=True)
    (micro,) = plan.updates[0][0]
    length_of = [lengths[src_row] for _, src_row in plan.sources[0]]  # the rank's batch after the balance
    docs_per_row = sorted(sorted(length_of[micro.rows[i]] for i in b) for b in micro.bins)
    assert docs_per_row == [[4, 5], [9]] and micro.row_width == 9

    per_token = 3 * (2 * 64 * 64 + 2 * 2 * 64 * 16 + 2 * 64 * 64 + 3 * 2 * 64 * 96) + 2 * 64 * 300
    attention_per_pair = 3 * (2 * 64 + 2 * 64)  # 3 layers, scores + values over 8 heads x 8 dims

    def pairs(s):
        return s * s / 2

    hand = (9 + 5 + 4) * per_token + attention_per_pair * (pairs(9) + pairs(5) + pairs(4))
    assert forward_flops(_arch(), lengths) == hand
    as_rows = 2 * 9 * per_token + attention_per_pair * 2 * pairs(9)  # what counting packed rows would say
    assert forward_flops(_arch(), [9, 9]) == as_rows > hand
