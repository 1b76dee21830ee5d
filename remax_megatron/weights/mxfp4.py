"""MXFP4 (OCP microscaling FP4) dequantization of gpt-oss's published expert tensors.

gpt-oss ships its expert matrices as pairs `<name>_blocks` / `<name>_scales` (config.json's
`quantization_config: {"quant_method": "mxfp4"}`), the layout transformers' integrations/mxfp4.py
reads:
- blocks: uint8 [E, out, in / 32, 16], two FP4 e2m1 codes per byte, the low nibble first
  (element 2j in bits 0-3, element 2j+1 in bits 4-7);
- scales: uint8 [E, out, in / 32], one e8m0 exponent per 32 elements (2 ** (s - 127); 255 is NaN).
Dequantized, a pair becomes `<name>` as transformers' GptOssExperts holds it, transposed to
[E, in, out] (gate_up_proj [E, hidden, 2*ffn], down_proj [E, ffn, hidden]).

Every e2m1 value times a power of two is exact in float32 and bfloat16 (at most two mantissa
bits, and their exponent range covers e8m0's up to scales near 2**126), so dequantization
loses nothing there; a value a dtype cannot hold (float16's smaller range) is refused by name.
"""

from __future__ import annotations

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# FP4 e2m1 by code: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS, E8M0_NAN = 127, 255
ELEMENTS_PER_SCALE = 32


def is_mxfp4(config: dict) -> bool:
    """Whether an HF config.json (as a dict) declares MXFP4-quantized tensors."""
    quant = config.get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"


def quantized_pairs(names) -> dict[str, tuple[str, str]]:
    """{dequantized name: (blocks name, scales name)} for every `_blocks` with its `_scales`."""
    names = set(names)
    pairs = {}
    for name in names:
        if name.endswith(BLOCKS):
            base = name[: -len(BLOCKS)]
            if base + SCALES not in names:
                raise ValueError(f"{name} has no {base + SCALES} beside it: re-download the model")
            pairs[base] = (name, base + SCALES)
    return pairs


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "tensor"):
    """blocks uint8 [..., out, G, 16], scales uint8 [..., out, G] -> dtype [..., G * 32, out].

    Refuses (one line) a mismatched layout, a NaN scale, and a dtype that cannot hold the values."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}: "
            "is config.json's quantization_config right for these weights?"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != ELEMENTS_PER_SCALE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"[..., out, G, {ELEMENTS_PER_SCALE // 2}] and [..., out, G]: re-download the model"
        )
    exponents = scales.to(torch.int32) - E8M0_BIAS
    if scales.numel() and bool((scales == E8M0_NAN).any()):
        raise ValueError(f"{name}: an MXFP4 scale is 255 (NaN in e8m0): the checkpoint is corrupt, re-download it")
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., out, G, 32]: nibble order low, high
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(dtype))
    out = values.flatten(-2)  # [..., out, in]
    if bool(torch.isinf(out).any()):
        raise ValueError(
            f"{name}: MXFP4 values up to 6 * 2**{int(exponents.max())} overflow {dtype} "
            f"(max {torch.finfo(dtype).max:.3g}): run in bfloat16 or float32"
        )
    return out.transpose(-1, -2).contiguous()  # [..., in, out]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., in, out] -> (blocks, scales) in the published layout; round to nearest e2m1 after
    scaling each 32-block so that its largest magnitude fits 6 (tests and tiny checkpoints)."""
    w = weight.transpose(-1, -2).to(torch.float64)  # [..., out, in]
    if w.shape[-1] % ELEMENTS_PER_SCALE:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {ELEMENTS_PER_SCALE}, got {w.shape[-1]}")
    w = w.reshape(*w.shape[:-1], w.shape[-1] // ELEMENTS_PER_SCALE, ELEMENTS_PER_SCALE)
    amax = w.abs().amax(-1).clamp_min(2.0**-120)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = w / torch.exp2(exponents).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # nearest code (+0 before -0)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponents + E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
