"""Model FLOPs of a step and the device's peak, for MFU.

Model FLOPs count the matmuls the model needs, not what an implementation does:
activation recompute and the redundant rollouts of the ranks of one
model-parallel group are not counted. For a dense decoder (GQA attention,
SwiGLU MLP) a forward over one sequence of length s costs

    L * [ s * (2h(q + 2 kv hd) + 2 q h + 6 h f) + 2 s^2 q ] + 2 s h V,   q = heads * hd

(QKV and output projections, gate/up/down, causal attention scores and values
at half of the full s^2, the logits). Training costs 3 forwards; a rollout
(prefill + decode with a KV cache) one forward over prompt + response.

Multi-latent attention (DeepSeek-V3) replaces the QKV projections by its down and up projections,
2h r_q + 2 r_q n (d_nope + d_rope) (or 2h n (d_nope + d_rope) without a q latent) and
2h (r_kv + d_rope) + 2 r_kv n (d_nope + d_v), the output by 2 n d_v h, and the scores and values by
s^2 n (d_nope + d_rope + d_v) (the causal half).
A sliding-window layer (window W: a query keeps the W most recent keys) scores W s - W^2 / 2 pairs
instead of s^2 / 2 once s > W (the same continuous count, equal at s = W).

MoE counts what a token actually passes through (active parameters): the router
(2 h E) and its k experts, 6 h f_expert each, in place of the dense 6 h f; plus the
shared experts (6 h f_shared) where a model has them. DeepSeek-style models keep the
dense 6 h f in their first layers (first_dense_layers).
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
    routed = 2 * h * arch.num_experts + 6 * h * (
        arch.moe_ffn_hidden_size * arch.moe_top_k + arch.moe_shared_ffn_hidden_size
    )
    mlp = arch.moe_layers * routed + (L - arch.moe_layers) * 6 * h * f  # all layers
    projections, scores = _attention(arch)
    per_token = L * projections + mlp
    head = 2 * h * (arch.vocab_size if arch.task == "causal_lm" else 1)
    windows = arch.layer_windows or (None,) * L
    total = 0.0
    for s in lengths:
        pairs = sum(attention_pairs(s, w) for w in windows)  # (query, key) pairs over the layers
        total += s * (per_token + head) + 2 * scores * pairs
    return total


def attention_pairs(s: int, window: int | None) -> float:
    """Causal (query, key) pairs of one sequence of length s: s^2 / 2, or W s - W^2 / 2 with a window
    of W keys once s > W."""
    if window is None or s <= window:
        return s * s / 2
    return window * s - window * window / 2


def _attention(arch) -> tuple[int, int]:
    """(one token's projection FLOPs, the causal scores-and-values FLOPs per s^2) of one attention layer."""
    h, n = arch.hidden_size, arch.num_heads
    if getattr(arch, "is_mla", False):
        nope, rope, v, kv_lora = arch.qk_head_dim, arch.qk_pos_emb_head_dim, arch.v_head_dim, arch.kv_lora_rank
        q_rows = n * (nope + rope)
        q_proj = 2 * h * q_rows if arch.q_lora_rank is None else 2 * arch.q_lora_rank * (h + q_rows)
        kv_proj = 2 * h * (kv_lora + rope) + 2 * kv_lora * n * (nope + v)
        return q_proj + kv_proj + 2 * n * v * h, n * (nope + rope + v)
    q = n * arch.head_dim  # == h unless the config sets head_dim
    return 2 * h * (q + 2 * arch.num_kv_heads * arch.head_dim) + 2 * q * h, 2 * q


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
