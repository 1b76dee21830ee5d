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
    from remax_megatron.models.arch import ModelArch

    arch = ModelArch(
        architecture="GptOssForCausalLM",
        family="gpt_oss",
        task="causal_lm",
        hidden_size=48,
        ffn_hidden_size=40,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        vocab_size=301,
        rms_norm_eps=1e-5,
        rope_theta=1.5e5,
        rope_scaling_factor=None,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        pad_token_id=None,
        torch_dtype="float32",
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
