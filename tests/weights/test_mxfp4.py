"""MXFP4 dequantization (gpt-oss's published experts) against an fp64 reference decoded bit by bit,
against transformers' own dequantizer, through the checkpoint reader, and its one-line refusals."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from remax_megatron.weights import HFCheckpointReader
from remax_megatron.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _e2m1_fp64(code: int) -> float:
    """FP4 e2m1 from its bits: sign 3, exponent 2-1 (bias 1), mantissa 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1.0 + mantissa / 2) * 2.0 ** (exponent - 1)


def _reference(blocks, scales):
    """fp64 [E, in, out] element by element: element 2j is byte j's low nibble, 2j+1 its high one."""
    e, out, groups, nbytes = blocks.shape
    ref = torch.empty(e, out, groups * 2 * nbytes, dtype=torch.float64)
    for i in range(e):
        for r in range(out):
            for g in range(groups):
                scale = 2.0 ** (int(scales[i, r, g]) - 127)
                for j in range(nbytes):
                    byte = int(blocks[i, r, g, j])
                    ref[i, r, g * 32 + 2 * j] = _e2m1_fp64(byte & 0xF) * scale
                    ref[i, r, g * 32 + 2 * j + 1] = _e2m1_fp64(byte >> 4) * scale
    return ref.transpose(1, 2)


def _random_packed(e=2, out=3, groups=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, out, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 20, (e, out, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dequantize_matches_fp64_bit_reference(dtype):
    blocks, scales = _random_packed()
    scales[0, 0, 0], scales[1, 2, 1] = 0, 252  # near e8m0's extremes: 2**-127, 2**125 (x6 < fp32 max)
    got = dequantize_mxfp4(blocks, scales, dtype)
    ref = _reference(blocks, scales)
    assert got.shape == (2, 64, 3) and got.dtype == dtype
    assert torch.equal(got.to(torch.float64), ref)  # exact: e2m1 x 2**k fits all three dtypes


def test_dequantize_matches_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _random_packed(e=3, out=5, groups=3, seed=1)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(ours, theirs)


def test_quantize_round_trip_within_rounding():
    weight = torch.randn(2, 64, 5, dtype=torch.float64)
    blocks, scales = quantize_mxfp4(weight)
    back = dequantize_mxfp4(blocks, scales, torch.float64)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back), torch.float64), back)  # fixed points
    # e2m1's worst spacing is 2 (between 4 and 6) in units of the block's scale, which puts the
    # block's largest magnitude in [3, 6]: half a step is at most 1/3 of it
    amax = weight.transpose(1, 2).reshape(2, 5, 2, 32).abs().amax(-1)
    err = (back - weight).abs().transpose(1, 2).reshape(2, 5, 2, 32).amax(-1)
    assert bool((err <= amax / 3 + 1e-12).all())


def test_reader_dequantizes_pairs_and_slices_experts(tmp_path):
    weight = torch.randn(4, 64, 6, dtype=torch.float64)
    blocks, scales = quantize_mxfp4(weight)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    save_file(
        {base + "_blocks": blocks, base + "_scales": scales, "model.norm.weight": torch.ones(6)},
        str(tmp_path / "model.safetensors"),
    )
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}, f)
    reader = HFCheckpointReader(str(tmp_path))
    assert sorted(reader.names()) == [base, "model.norm.weight"]
    full = dequantize_mxfp4(blocks, scales, torch.float32)
    assert reader.dtype(base) == torch.float32
    assert torch.equal(reader.read(base), full)
    assert torch.equal(reader.read(base, 0, 1, 3), full[1:3])
    assert torch.equal(reader.read(base, 2, 2, 5), full[:, :, 2:5])
    os.remove(tmp_path / "config.json")  # without the config's quant_method the raw tensors stay
    assert base + "_blocks" in HFCheckpointReader(str(tmp_path)).names()


def test_refusals_name_the_problem():
    blocks, scales = _random_packed()
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks[..., :8], scales, torch.float32, "w")
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales, torch.float32, "w")
    bad = scales.clone()
    bad[0, 0, 0] = 255
    with pytest.raises(ValueError, match="255 .NaN in e8m0."):
        dequantize_mxfp4(blocks, bad, torch.float32, "w")
    big = scales.clone()
    big[0, 0, 0] = 127 + 20
    with pytest.raises(ValueError, match=r"overflow torch.float16 .* run in bfloat16 or float32"):
        dequantize_mxfp4(blocks, big, torch.float16, "w")
