"""HF -> megatron checkpoint -> HF at TP=2, PP=2 under torchrun: bitwise round trip; bad input refused."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.models.family_helpers import round_trip_body
from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def _run(args, env_extra=None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    env = {k: v for k, v in env.items() if v != ""}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kw)


def _tensors(model_dir):
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("family,tie", [("qwen2", False), ("llama", True)])
def test_round_trip_tp2_pp2_is_bitwise(tmp_path, family, tie):
    """The command lines, as a user runs them."""
    hf = make_tiny_model(
        str(tmp_path / "hf"), family, hidden=64, layers=4, heads=4, kv_heads=2, ffn=96, vocab=300, tie=tie, seed=5
    )
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", ckpt])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(
        [
            TORCHRUN,
            "--nproc_per_node=4",
            "tools/convert_megatron_to_hf.py",
            "--ckpt",
            ckpt,
            "--out",
            out,
            "--tp",
            "2",
            "--pp",
            "2",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = _tensors(hf), _tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name], tensor), name
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings == tie


# (HF -> megatron layout, megatron -> HF layout) as (tp, pp, ep, etp), each run by the converters' own
# functions inside one launch of 4 processes (as torchrun would run them; the CLI is tested above)
FAMILY_ROUND_TRIPS = {
    "qwen3": ("qwen3", False, {"head_dim": 32}, (1, 1, 1, 0), (2, 2, 1, 0)),
    "qwen3-tied": ("qwen3", True, {}, (2, 1, 1, 0), (2, 2, 1, 0)),
    "mistral": ("mistral", False, {"head_dim": 32, "sliding_window": 256}, (1, 2, 1, 0), (2, 2, 1, 0)),
    # EP=2 (over DP), then TP2 x EP2 with whole experts (EP over the TP ranks)
    "qwen3_moe": ("qwen3_moe", False, {"experts": 4, "top_k": 2}, (1, 1, 2, 0), (2, 1, 2, 1)),
    # TP2 x EP2 with experts split over TP too, then PP2 x EP2
    "mixtral": ("mixtral", False, {"experts": 4, "top_k": 2}, (2, 1, 2, 2), (1, 2, 2, 0)),
}


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    from tests._dist import SharedLaunches

    top = tmp_path_factory.mktemp("round-trips")
    cases = {}
    for name, (family, tie, options, to_megatron, to_hf) in FAMILY_ROUND_TRIPS.items():
        ffn = 32 if "experts" in options else 96
        hf = make_tiny_model(
            str(top / name / "hf"),
            family,
            hidden=64,
            layers=4,
            heads=4,
            kv_heads=2,
            ffn=ffn,
            vocab=300,
            tie=tie,
            seed=5,
            **options,
        )
        cases[name] = (round_trip_body, (hf, str(top / name / "ckpt"), str(top / name / "out"), to_megatron, to_hf))
    return SharedLaunches({4: cases}, str(top / "launches"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILY_ROUND_TRIPS))
def test_round_trip_of_each_family_is_bitwise(round_trips, name):
    """HF -> megatron -> HF bitwise through both converters for Qwen3 (tied, untied, head_dim != hidden /
    heads), Mistral and the MoE families through expert-parallel layouts (EP2, TP2 x EP2 with etp 1 and 2,
    PP2 x EP2)."""
    round_trips.check(name)


def test_megatron_to_hf_names_the_world_an_expert_layout_needs(tmp_path):
    from tools import convert_megatron_to_hf

    hf = make_tiny_model(str(tmp_path / "hf"), "mixtral", hidden=32, layers=2, heads=2, kv_heads=1, ffn=32, experts=4)
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", str(tmp_path / "ckpt")])
    assert r.returncode == 0, r.stderr[-3000:]
    with pytest.raises(
        ValueError,
        match=r"world size 1 but tp\(1\) \* pp\(1\) with ep\(2\) \* etp\(1\) needs 2 "
        r"processes \(or a multiple\): launch with torchrun --nproc_per_node=2",
    ):
        convert_megatron_to_hf.convert(str(tmp_path / "ckpt"), str(tmp_path / "out"), ep=2)


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


def _tree(top):
    """{relative path: sha256 of its bytes} of every file under `top` (a file: {'': digest})."""
    import hashlib

    def digest(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    if os.path.isfile(top):
        return {"": digest(top)}
    out = {}
    for dirpath, dirnames, names in os.walk(top):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), top) + "/"] = "dir"
        for name in names:
            out[os.path.relpath(os.path.join(dirpath, name), top)] = digest(os.path.join(dirpath, name))
    return out


def _one_error_line(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def _refused(tool, args, capsys):
    """The tool's main() in this process (a refusal comes before any process group): exit 2, one line
    on stderr; test_converter_refuses_unsupported_architecture runs the same path as a real process."""
    main = importlib.import_module(f"tools.convert_{tool}").main
    capsys.readouterr()  # what came before (make_tiny_model's progress bar) is not the tool's
    with pytest.raises(SystemExit) as exited:
        main(args)
    captured = capsys.readouterr()
    assert exited.value.code == 2, captured.err[-3000:]
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny HF model and the model checkpoint convert_hf_to_megatron.py wrote from it."""
    top = tmp_path_factory.mktemp("converted")
    hf = make_tiny_model(str(top / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    ckpt = str(top / "ckpt")
    r = _run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", ckpt])
    assert r.returncode == 0, r.stderr[-3000:]
    return hf, ckpt


def _run_dir(path):
    """A training run's output directory: what a converter must never delete."""
    os.makedirs(os.path.join(path, "checkpoints", "step_000002", "model"))
    with open(os.path.join(path, "checkpoints", "step_000002", "model", "__0_0.distcp"), "wb") as f:
        f.write(os.urandom(5000))
    with open(os.path.join(path, "checkpoints", "latest"), "w") as f:
        f.write("step_000002")
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 0.5}\n')
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("my notes\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["hf_to_megatron", "megatron_to_hf"])
@pytest.mark.parametrize("target,overwrite", [("run_dir", False), ("run_dir", True), ("file", True)])
def test_converter_refuses_an_existing_out_and_leaves_it_byte_identical(
    converted, tmp_path, capsys, tool, target, overwrite
):
    """A training run's directory or a file at --out: one line, exit 2, not a byte changed, nothing
    added beside it; --overwrite does not change that (it replaces only what the tool wrote)."""
    hf, ckpt = converted
    out = _run_dir(str(tmp_path / "run")) if target == "run_dir" else os.path.join(hf, "config.json")
    parent = os.path.dirname(out)
    before, beside = _tree(out), sorted(os.listdir(parent))
    src = ["--hf-dir", hf] if tool == "hf_to_megatron" else ["--ckpt", ckpt]
    line = _refused(tool, [*src, "--out", out] + (["--overwrite"] if overwrite else []), capsys)
    assert out in line
    assert ("is an existing file" if target == "file" else "is not empty and is not") in line, line
    assert _tree(out) == before
    assert sorted(os.listdir(parent)) == beside


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["hf_to_megatron", "megatron_to_hf"])
def test_overwrite_replaces_only_what_the_tool_wrote(converted, tmp_path, capsys, tool):
    hf, ckpt = converted
    out = str(tmp_path / "out")
    args = [*(["--hf-dir", hf] if tool == "hf_to_megatron" else ["--ckpt", ckpt]), "--out", out]
    cmd = [PY, f"tools/convert_{tool}.py", *args]
    assert _run(cmd).returncode == 0
    first = _tree(out)
    line = _refused(tool, args, capsys)  # without --overwrite: refused, untouched
    assert "already holds" in line and "--overwrite" in line
    assert _tree(out) == first
    r = _run(cmd + ["--overwrite"])  # the tool's own output: replaced, and said so
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("--overwrite: ")]
    assert len(said) == 1 and out in said[0], r.stdout
    # megatron-core's writer: 5 files in model/ up to 0.16 (two writer threads, common.pt), 3 from 0.19 (one thread)
    shards = len(os.listdir(os.path.join(out, "model"))) if tool == "hf_to_megatron" else None
    expected = (
        f"hf_config/ (5 files), model/ ({shards} files), remax_checkpoint.json"
        if tool == "hf_to_megatron"
        else "config.json, generation_config.json, model.safetensors, remax_written_by.json"
    )
    assert expected in said[0], said[0]
    assert sorted(first) == sorted(_tree(out))
    with open(os.path.join(out, "notes.txt"), "w") as f:  # a user's file added: no longer only the tool's
        f.write("keep me\n")
    before = _tree(out)
    line = _refused(tool, args + ["--overwrite"], capsys)
    assert "notes.txt" in line and "does not replace it either" in line, line
    assert _tree(out) == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.slow
def test_converter_names_a_missing_out_parent(converted, tmp_path, capsys):
    hf, _ = converted
    out = str(tmp_path / "no" / "such" / "ckpt")
    line = _refused("hf_to_megatron", ["--hf-dir", hf, "--out", out], capsys)
    assert f"parent directory {tmp_path / 'no' / 'such'} does not exist" in line and ".tmp" not in line, line
    assert not os.path.exists(tmp_path / "no")


def test_converter_names_a_bad_config_json(tmp_path, capsys):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], ')
    line = _refused("hf_to_megatron", ["--hf-dir", hf, "--out", str(tmp_path / "c")], capsys)
    assert os.path.join(hf, "config.json") in line and "not valid JSON" in line, line
    assert not os.path.exists(tmp_path / "c")


def test_converter_refuses_tp_not_dividing_heads(tmp_path, capsys):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=48, layers=2, heads=3, kv_heads=3, ffn=64)
    line = _refused("hf_to_megatron", ["--hf-dir", hf, "--out", str(tmp_path / "c"), "--tp", "2"], capsys)
    assert "--tp=2 does not divide num_attention_heads=3" in line, line
    assert not os.path.exists(tmp_path / "c")


def test_converter_refuses_unsupported_architecture(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=32, layers=2, heads=2, kv_heads=1, ffn=64)
    cfg_path = os.path.join(hf, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    line = _one_error_line(_run([PY, "tools/convert_hf_to_megatron.py", "--hf-dir", hf, "--out", str(tmp_path / "c")]))
    assert "unsupported architecture 'GPTNeoXForCausalLM'" in line, line
    # The message lists the registry's families and what each serves.
    assert "qwen3 (Qwen3ForCausalLM, Qwen3ForSequenceClassification)" in line, line
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.slow
def test_the_tools_print_only_their_result_and_the_export_states_its_dtype(converted, tmp_path):
    """make_tiny_model and convert_megatron_to_hf (as run from a shell): their one line, nothing on stderr (no
    megatron-core warnings, no transformers progress bars); --dtype bfloat16 writes a config.json that says so."""
    r = _run(
        [
            PY,
            "tools/make_tiny_model.py",
            "--out",
            str(tmp_path / "tiny"),
            "--family",
            "qwen2",
            "--hidden",
            "32",
            "--layers",
            "2",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--ffn",
            "64",
        ]
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"wrote {tmp_path / 'tiny'}\n", ""), r.stderr[-3000:]
    _, ckpt = converted
    out = str(tmp_path / "bf16")
    r = _run(
        [PY, "tools/convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", out, "--dtype", "bfloat16"],
        env_extra={"PYTHONWARNINGS": ""},
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"wrote {out}\n", ""), r.stderr[-3000:]
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in _tensors(out).values()} == {torch.bfloat16}
