"""FP8 block-quantized checkpoints (DeepSeek-V3 / R1, Kimi K2): dequantized on import.

Such a checkpoint stores a linear weight `W` [rows, cols] as float8_e4m3fn next to
`W_scale_inv` [ceil(rows / br), ceil(cols / bc)] (float32), one scale per br x bc block
(`quantization_config.weight_block_size`, [128, 128] as published): the real weight is
`W[i, j] * W_scale_inv[i // br, j // bc]`. The product is taken in float32 (as transformers'
and vLLM's dequantizers do) and the caller casts it to the run's dtype.
"""

from __future__ import annotations

import math

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def block_size_of(quantization_config: dict | None, source: str) -> tuple[int, int] | None:
    """The (rows, cols) block of a config.json's `quantization_config`; None when there is none.

    Anything but FP8 e4m3 weights with a 2-D block and dynamic activations is refused in one line.
    """
    if not quantization_config:
        return None
    qc = quantization_config
    method, fmt = qc.get("quant_method"), qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"{source}: quantization_config (quant_method={method!r}, fmt={fmt!r}, activation_scheme="
            f"{qc.get('activation_scheme')!r}) is not supported: only FP8 e4m3 block-quantized weights are "
            "dequantized on import; give a bf16 / fp32 checkpoint instead"
        )
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"{source}: quantization_config.weight_block_size={block!r} is not two positive integers "
            "(e.g. [128, 128]): per-tensor FP8 checkpoints are not supported; give a bf16 checkpoint instead"
        )
    return int(block[0]), int(block[1])


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], row_offset: int = 0, col_offset: int = 0
) -> torch.Tensor:
    """float32 `weight * scale_inv` broadcast over blocks.

    weight: [r, c] FP8, a slice of the full tensor starting at (row_offset, col_offset);
    scale_inv: [R, C] the scales of the blocks that slice touches (block row row_offset // br first).
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 block dequantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    br, bc = block
    r0, c0 = row_offset % br, col_offset % bc  # where the slice starts inside its first block
    rows_needed = math.ceil((r0 + weight.shape[0]) / br)
    cols_needed = math.ceil((c0 + weight.shape[1]) / bc)
    if scale_inv.shape[0] < rows_needed or scale_inv.shape[1] < cols_needed:
        raise ValueError(
            f"FP8 scale_inv of shape {tuple(scale_inv.shape)} does not cover a weight of shape "
            f"{tuple(weight.shape)} in {br}x{bc} blocks: does quantization_config.weight_block_size match the weights?"
        )
    scale = scale_inv[:rows_needed, :cols_needed].to(torch.float32)
    scale = scale.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    scale = scale[r0 : r0 + weight.shape[0], c0 : c0 + weight.shape[1]]
    return weight.to(torch.float32) * scale


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale_inv) of a 2-D weight, one scale per block (amax / 448): how the
    published checkpoints were made; tools and tests use it to write a quantized checkpoint."""
    br, bc = block
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(nr, br, nc, bc)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / fp8_max).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale_inv
