"""Model FLOPs of a step and the device's peak, for MFU.

Model FLOPs count the matmuls the model needs, not what an implementation does:
activation recompute and the redundant rollouts of the ranks of one
model-parallel group are not counted. For a dense decoder (GQA attention,
SwiGLU MLP) a forward over one sequence of length s costs

    L * [ s * (2h(q + 2 kv hd) + 2 q h + 6 h f) + 2 s^2 q ] + 2 s h V,   q = heads * hd

(QKV and output projections, gate/up/down, causal attention scores and values
at half of the full s^2, the logits). Training costs 3 forwards; a rollout
(prefill + decode with a KV cache) one forward over prompt + response.

MoE counts what a token actually passes through (active parameters): the router
(2 h E) and its k experts, 6 h f_expert each, in place of the dense 6 h f.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Dense peaks per device (TFLOP/s, no sparsity), from NVIDIA's data sheets: bf16/fp16 and TF32
# tensor cores, plain fp32 (fp32 matmuls use TF32 only when torch.backends.cuda.matmul.allow_tf32).
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM; PCIe parts are lower: trainer.peak_tflops
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "tf32": 183.1, "fp32": 91.6},
}


def forward_flops(arch, lengths: Iterable[int]) -> float:
    """FLOPs of one forward of `arch` over sequences of these lengths (see module docstring)."""
    h, f, L = arch.hidden_size, arch.ffn_hidden_size, arch.num_layers
    q = arch.num_heads * arch.head_dim  # == h unless the config sets head_dim
    mlp = (2 * h * arch.num_experts + 6 * h * arch.moe_ffn_hidden_size * arch.moe_top_k) if arch.is_moe else 6 * h * f
    per_token = L * (2 * h * (q + 2 * arch.num_kv_heads * arch.head_dim) + 2 * q * h + mlp)
    head = 2 * h * (arch.vocab_size if arch.task == "causal_lm" else 1)
    total = 0.0
    for s in lengths:
        total += s * (per_token + head) + L * 2 * s * s * q
    return total


def peak_tflops(dtype: torch.dtype, override: float = 0.0) -> float | None:
    """Peak TFLOP/s of this rank's device for `dtype`; `override` (> 0) wins; None when unknown (CPU)."""
    if override > 0:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    if dtype in (torch.bfloat16, torch.float16):
        key = "bf16"
    else:
        key = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    for model, peaks in PEAK_TFLOPS.items():
        if model in name:
            return peaks[key]
    return None
