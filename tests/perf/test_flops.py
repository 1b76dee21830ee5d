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
