"""tools/bench_noise_floor.py end to end on a small random tied Llama (2 layers, native engine only): every row
is there, measured on the model it names, and within a few fp32 steps of transformers' own eager-vs-sdpa
floor. The 30-layer figures are in docs/benchmarks.md."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_every_row_is_measured_against_the_floor(tmp_path):
    out = tmp_path / "noise.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "tools", "bench_noise_floor.py"),
        "--json",
        str(out),
        "--layers",
        "2",
        "--hidden",
        "128",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--ffn",
        "128",
        "--vocab",
        "512",
        "--completion-len",
        "8",
        "--engines",
        "native",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == [
        "floor",
        "actor_vs_hf",
        "floor_merged",
        "lora_actor_vs_merged_hf",
        "peft_vs_merged",
        "native_vs_actor",
    ]
    assert result["model"]["num_hidden_layers"] == 2 and result["model"]["tie_word_embeddings"]
    assert rows["lora_actor_vs_merged_hf"]["adapter_effect_logprob"] > 1e-2  # the adapters do something
    for row in rows.values():
        assert row["max_logprob_diff"] < 1e-5 and row["tokens"] > 0, row
        floor = rows[row.get("floor_row", "floor")]["max_logprob_diff"]  # the LoRA rows: the merged model's
        assert row["x_floor_logprob"] == (pytest.approx(row["max_logprob_diff"] / floor) if floor else None), row
