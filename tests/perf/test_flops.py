"""Model FLOPs (remax_megatron.flops) against torch's FLOP counter on the transformers model."""

import torch

from tools.make_tiny_model import make_tiny_model


def test_forward_flops_match_torch_flop_counter(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from remax_megatron.flops import forward_flops
    from remax_megatron.models import read_hf_config

    model_dir = make_tiny_model(str(tmp_path / "m"), "qwen2", hidden=64, layers=3, heads=4, kv_heads=2, ffn=96,
                                vocab=300, seed=0)
    arch = read_hf_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    total = 0
    for s in (16, 5):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randint(4, 300, (1, s)))
        total += counter.get_total_flops()
        # The eager attention computes the full s x s scores and values (4 s^2 h per layer);
        # model FLOPs count the causal half.
        total -= 2 * arch.num_layers * s * s * arch.hidden_size
    assert forward_flops(arch, [16, 5]) == total


def test_peak_tflops_override_and_cpu():
    from remax_megatron.flops import peak_tflops

    assert peak_tflops(torch.bfloat16, override=123.0) == 123.0
    if not torch.cuda.is_available():
        assert peak_tflops(torch.bfloat16) is None  # MFU is not reported without a known peak
