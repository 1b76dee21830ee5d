"""The SDPA core attention on a GPU (collected only with CUDA; tools/gpu_check.sh runs it).

- each fused SDPA backend (flash, cuDNN, memory-efficient) against the math backend on the same module and
  inputs, causal GQA 8 / 2 heads, bf16 and fp32: forward and q / k / v gradients (a backend that does not
  take the dtype or shape is skipped, naming it)
- the FlexAttention path (compiled; windows and sinks on CUDA) against the dense fp64 reference of
  tests/models/test_attention.py, forward and the sink's gradient against the CPU path
- fully masked rows: zeros and finite gradients on every backend that runs them
"""

import math

import pytest
import torch

from remax_megatron.models.attention import TorchDotProductAttention
from tests.models.test_attention import HEAD_DIM, HEADS, _config, _hf_sliding, _ours, _qkv, _reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")

BACKENDS = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]
# max |diff| to the math backend, relative to the largest entry: fp32 rounding, or bf16's 8 bits
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _on_cuda(module: TorchDotProductAttention) -> TorchDotProductAttention:
    return module.cuda()


def _fwd_bwd(module, qkv, mask=None):
    q, k, v = (x.detach().cuda().requires_grad_() for x in qkv)
    out = module(q, k, v, mask)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    (out * cotangent).sum().backward()
    return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_math(backend, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module = _on_cuda(_ours(_config(params_dtype=dtype, bf16=dtype == torch.bfloat16)))
    qkv = _qkv(s=256, b=2, dtype=dtype)
    with sdpa_kernel([SDPBackend.MATH]):
        want = _fwd_bwd(module, qkv)
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            got = _fwd_bwd(module, qkv)
    except RuntimeError as e:
        if "No available kernel" in str(e):
            pytest.skip(f"{backend} takes no {dtype} causal GQA here: {str(e).splitlines()[0]}")
        raise
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err <= TOL[dtype], f"{backend} {dtype} {name}: relative max |diff| {err:.3g}"


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_flex_window_and_sink_match_reference(softmax_type):
    s, window = 300, 64  # more than one of FlexAttention's 128-token blocks, a window across them
    config = _config(softmax_type=softmax_type, window_size=(window - 1, 0), window_attn_skip_freq=None)
    module = _on_cuda(_ours(config))
    if softmax_type == "learnable":
        with torch.no_grad():
            module.softmax_offset.copy_(torch.linspace(-2, 3, HEADS))
    qkv = _qkv(s=s, b=2)
    sink = module.softmax_offset.detach().cpu() if softmax_type == "learnable" else None
    want = _reference(qkv, _hf_sliding(s, window), 1 / math.sqrt(HEAD_DIM), sink)
    got = module(*(x.detach().cuda() for x in qkv), None)
    assert (got.double().cpu() - want).abs().max() < 1e-5
    if softmax_type == "learnable":  # the sink's gradient through FlexAttention equals the CPU path's
        module.zero_grad()
        module(*(x.detach().cuda() for x in qkv), None).square().sum().backward()
        cpu = _ours(config)
        with torch.no_grad():
            cpu.softmax_offset.copy_(module.softmax_offset.cpu())
        cpu(*(x.detach() for x in qkv), None).square().sum().backward()
        err = (module.softmax_offset.grad.cpu() - cpu.softmax_offset.grad).abs().max()
        assert err <= 1e-4 * max(1.0, cpu.softmax_offset.grad.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fully_masked_rows_on_cuda(dtype):
    module = _on_cuda(_ours(_config(params_dtype=dtype, bf16=dtype == torch.bfloat16)))
    s, b = 64, 2
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).repeat(b, 1, 1, 1)
    mask[1] = True
    out, dq, dk, dv = _fwd_bwd(module, _qkv(s, b, dtype), mask.cuda())
    assert out[:, 1].abs().max() == 0 and out[:, 0].abs().max() > 0
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
