"""tools/bench_e2e.py on a tiny model (native engine, no peer): the JSON contract of DESIGN.md."""

import json
import math
import os
import subprocess
import sys

import pytest

from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every stage of the trainer's step (remax_megatron/trainer.py) plus the totals.
STAGES = ("sync", "rollout", "reward", "pack", "logprobs", "update", "metrics", "train", "step")


@pytest.mark.slow
def test_bench_e2e_json_contract(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    out = tmp_path / "e2e.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "tools/bench_e2e.py", "--hf-dir", hf, "--json", str(out), "--steps", "2",
                        "--warmup", "1", "--greedy-repeats", "1", "actor.tp=1", "rollout.engine=native",
                        "trainer.prompts_per_step=4", "rollout.n=2", "trainer.micro_batch_size=4"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(r.stdout[r.stdout.index("{"):]) == result  # the same object on stdout

    def positive(x):
        return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

    assert positive(result["samples_per_s"]) and positive(result["tokens_per_s"])
    assert result["engine"] == "native"
    assert result["layout"] == {"world": 1, "actor_tp": 1, "actor_pp": 1, "dp": 1, "rollout_tp": 1}
    assert set(result["stages"]) == {f"time/{s}_s" for s in STAGES}
    assert all(positive(result["stages"][f"time/{s}_s"]) for s in ("rollout", "update", "train", "step"))
    # samples/s is the median over the measured steps of n * prompts / step time.
    assert len(result["step_s"]) == 2
    per_step = sorted(8 / s for s in result["step_s"])
    assert result["samples_per_s"] == pytest.approx(sum(per_step) / 2)
    greedy = result["greedy_row"]
    assert positive(greedy["with_greedy_s"]) and positive(greedy["sampling_only_s"])
    assert greedy["ratio"] == pytest.approx(greedy["with_greedy_s"] / greedy["sampling_only_s"])
    assert greedy["bound"] == pytest.approx(1.5)
    assert "peer_samples_per_s" not in result and "ratio" not in result
