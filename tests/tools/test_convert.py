"""HF -> megatron checkpoint -> HF at TP=2, PP=2 under torchrun: bitwise round trip; bad input refused."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def _run(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kw)


def _tensors(model_dir):
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_round_trip_tp2_pp2_is_bitwise(tmp_path, family, tie):
    hf = make_tiny_model(str(tmp_path / "hf"), family, hidden=64, layers=4, heads=4, kv_heads=2, ffn=96,
                         vocab=300, tie=tie, seed=5)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", ckpt])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run([TORCHRUN, "--nproc_per_node=4", "tools/convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", out,
              "--tp", "2", "--pp", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = _tensors(hf), _tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name], tensor), name
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings == tie


def test_sharded_hf_dir_round_trip(tmp_path):
    """A sharded (indexed) HF directory is read and written through the same code."""
    from remax_megatron.weights import HFCheckpointReader, write_hf_dir

    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    tensors = _tensors(hf)
    sharded = str(tmp_path / "sharded")
    write_hf_dir(sharded, tensors.items(), side_files_from=hf, max_shard_bytes=20_000)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    reader = HFCheckpointReader(sharded)
    assert sorted(reader.names()) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(reader.read(name), tensor)
        assert torch.equal(reader.read(name, 0, 1, 3), tensor[1:3])


def test_converter_refuses_existing_output_and_writes_nothing(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    before = sorted(os.listdir(hf))
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", hf])
    assert r.returncode != 0
    assert "already holds a checkpoint" in r.stderr and "--overwrite" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(hf)) == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


def test_converter_refuses_tp_not_dividing_heads(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=48, layers=2, heads=3, kv_heads=3, ffn=64)
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", str(tmp_path / "c"), "--tp", "2"])
    assert r.returncode != 0 and "does not divide num_attention_heads=3" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "c")


def test_converter_refuses_unsupported_architecture(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    cfg_path = os.path.join(hf, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["MixtralForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", str(tmp_path / "c")])
    assert r.returncode != 0 and "unsupported architecture ['MixtralForCausalLM']" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(tmp_path / "c")
