"""tools/bench_rollout.py on a tiny model: the native engine and transformers' generate (TRL's engine without
vLLM) in one run, on --device cpu: tokens/s of each, the ratios, the JSON."""

import json
import os
import subprocess
import sys

import pytest

from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "tools/bench_rollout.py", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_native_and_transformers_generate_rows_in_one_run(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=500)
    out = tmp_path / "rollout.json"
    r = _bench(
        "--hf-dir", hf, "--engines", "native,transformers-generate", "--device", "cpu", "--dtype", "fp32",
        "--prompts", "3", "--n", "2", "--max-new-tokens", "6", "--repeats", "1", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["dtype"] == "fp32"
    rows = {row["engine"]: row for row in result["results"]}
    assert set(rows) == {"native", "transformers-generate"}
    for row in rows.values():
        # 3 prompts x (2 sampled + 1 greedy) rows of at most 6 tokens; a random model rarely ends early
        assert row["prompts"] == 3 and row["n"] == 2 and row["tokens_per_s"] > 0
        assert 0 < row["tokens_per_s"] * row["seconds"] <= 3 * 3 * 6
    native, generate = rows["native"]["tokens_per_s"], rows["transformers-generate"]["tokens_per_s"]
    assert result["ratios"]["native_over_transformers-generate"] == pytest.approx(native / generate)
    assert result["ratios"]["transformers-generate_over_native"] == pytest.approx(generate / native)


def test_an_unknown_engine_is_refused_with_the_choices():
    r = _bench("--hf-dir", "/nonexistent", "--engines", "native,sglang")
    assert r.returncode == 2 and "sglang" in r.stderr and "transformers-generate" in r.stderr
