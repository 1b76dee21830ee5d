"""Missing and truncated safetensors files are refused by name before any work."""

import json
import os

import pytest

from remax_megatron.models import read_hf_config
from remax_megatron.weights import HFCheckpointReader, write_hf_dir
from tools.make_tiny_model import make_tiny_model


@pytest.fixture
def hf(tmp_path):
    return make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)


def test_truncated_file_is_named(hf):
    path = os.path.join(hf, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        HFCheckpointReader(hf)


def test_garbage_file_is_named(hf):
    with open(os.path.join(hf, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        HFCheckpointReader(hf)


def test_missing_weights_and_missing_shard(hf, tmp_path):
    os.remove(os.path.join(hf, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        HFCheckpointReader(hf)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is listed"):
        HFCheckpointReader(hf)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        read_hf_config(str(tmp_path))


def test_unsupported_rope_and_sliding_window(hf):
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        read_hf_config(hf)


def test_writer_keeps_existing_model_unless_overwrite(hf, tmp_path):
    before = open(os.path.join(hf, "model.safetensors"), "rb").read()
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_hf_dir(hf, [])
    assert open(os.path.join(hf, "model.safetensors"), "rb").read() == before


def test_writer_failure_leaves_nothing(tmp_path):
    out = str(tmp_path / "out")

    def broken():
        import torch

        yield "a", torch.zeros(2)
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError):
        write_hf_dir(out, broken())
    assert not os.path.exists(out)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_written_config_states_the_dtype_of_its_tensors(hf, tmp_path, dtype):
    """The side files come from a float32 model; the tensors written decide config.json's dtype."""
    import torch

    tensors = {name: t.to(getattr(torch, dtype)) for name, t in HFCheckpointReader(hf).tensors()}
    out = str(tmp_path / "out")
    write_hf_dir(out, tensors.items(), side_files_from=hf)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == config["torch_dtype"] == dtype
    with open(os.path.join(hf, "config.json")) as f:
        source = json.load(f)
    assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")
    }
