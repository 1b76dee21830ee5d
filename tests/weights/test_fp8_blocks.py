"""FP8 block-quantized checkpoints (DeepSeek-V3's `weight_scale_inv`) dequantize on import."""

import json

import pytest
import torch
from safetensors.torch import save_file

from remax_megatron.weights import fp8_blocks
from remax_megatron.weights.hf_io import HFCheckpointReader, write_hf_dir

QC = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _reference(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """fp64 W[i, j] * S[i // br, j // bc], element by element through index arithmetic."""
    rows, cols = q.shape
    i = torch.arange(rows)[:, None] // block[0]
    j = torch.arange(cols)[None, :] // block[1]
    return q.to(torch.float64) * scale_inv.to(torch.float64)[i, j]


def _checkpoint(tmp_path, qc=QC, with_scale=True):
    torch.manual_seed(0)
    # Odd shapes: the last block row and column are partial (300 = 2 * 128 + 44, 200 = 128 + 72).
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 300)[:, None]
    q, scale_inv = fp8_blocks.quantize(w, (128, 128))
    tensors = {"model.layers.0.mlp.down_proj.weight": q, "model.norm.weight": torch.ones(200, dtype=torch.bfloat16)}
    if with_scale:
        tensors["model.layers.0.mlp.down_proj.weight_scale_inv"] = scale_inv
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"model_type": "deepseek_v3"}
    if qc is not None:
        config["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(config))
    return w, q, scale_inv


def test_dequantize_matches_fp64_reference_whole_and_sliced(tmp_path):
    w, q, scale_inv = _checkpoint(tmp_path)
    reader = HFCheckpointReader(str(tmp_path))
    name = "model.layers.0.mlp.down_proj.weight"
    assert reader.names() == [name, "model.norm.weight"]  # the scale is not a model tensor
    ref = _reference(q, scale_inv, (128, 128))
    whole = reader.read(name)
    assert whole.dtype == torch.float32
    # float32 product of an fp8 value and a float32 scale: one float32 rounding of the fp64 product.
    torch.testing.assert_close(whole.double(), ref, rtol=2.0**-24, atol=0)
    # A TP rank's slice starting inside a block (rows 150:300, columns 70:133) reads the same values.
    torch.testing.assert_close(reader.read(name, 0, 150, 300), whole[150:300], rtol=0, atol=0)
    torch.testing.assert_close(reader.read(name, 1, 70, 133), whole[:, 70:133], rtol=0, atol=0)
    # To the run's dtype: bf16 of the float32 value.
    assert torch.equal(whole.to(torch.bfloat16), ref.float().to(torch.bfloat16))
    # Within e4m3's rounding of the original weight (3 mantissa bits: half an ulp is 2^-4 relative).
    blockmax = ref.abs().amax()
    assert ((whole.double() - w.double()).abs() <= w.double().abs() * 2.0**-4 + blockmax * 2.0**-9).all()
    assert reader.read("model.norm.weight").dtype == torch.bfloat16  # unquantized tensors untouched


def test_slice_that_forgets_its_block_offset_breaks_parity(tmp_path):
    """Rows 150:300 scaled as if they started a block are caught by the reference (the test can fail)."""
    _, q, scale_inv = _checkpoint(tmp_path)
    wrong = fp8_blocks.dequantize(q[150:300], scale_inv[1:], (128, 128))
    right = fp8_blocks.dequantize(q[150:300], scale_inv[1:], (128, 128), row_offset=150)
    ref = _reference(q, scale_inv, (128, 128))[150:300]
    torch.testing.assert_close(right.double(), ref, rtol=2.0**-24, atol=0)
    assert not torch.allclose(wrong.double(), ref)


@pytest.mark.parametrize(
    "qc, with_scale, match",
    [
        ({"quant_method": "gptq", "bits": 4}, True, "quant_method='gptq'"),
        ({**QC, "weight_block_size": None}, True, "weight_block_size=None"),
        (None, True, "no quantization_config.weight_block_size"),
        (QC, False, "is FP8 with no model.layers.0.mlp.down_proj.weight_scale_inv"),
    ],
)
def test_refusals_in_one_line(tmp_path, qc, with_scale, match):
    _checkpoint(tmp_path, qc=qc, with_scale=with_scale)
    with pytest.raises(ValueError, match=match) as e:
        HFCheckpointReader(str(tmp_path))  # on opening: before any tensor is read
    assert "\n" not in str(e.value)


def test_export_of_a_dequantized_checkpoint_drops_quantization_config(tmp_path):
    src, out = tmp_path / "fp8", tmp_path / "out"
    src.mkdir()
    _checkpoint(src)
    reader = HFCheckpointReader(str(src))
    write_hf_dir(str(out), ((n, t.to(torch.bfloat16)) for n, t in reader.tensors()), side_files_from=str(src))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    back = HFCheckpointReader(str(out))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(back.read(name), reader.read(name).to(torch.bfloat16))
