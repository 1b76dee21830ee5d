"""tools/bench_e2e.py on a tiny model (native engine, no peer): the JSON contract of DESIGN.md."""

import json
import math
import os
import subprocess
import sys

import pytest

from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every stage of the trainer's step (remax_megatron/trainer.py; wait: the reward stage's wait on other ranks), totals.
STAGES = ("sync", "rollout", "wait", "reward", "pack", "logprobs", "update", "metrics", "train", "step")


def _tiny_llama(tmp_path):
    """A 2-layer Llama: a benchmark step on it takes seconds on CPU."""
    return make_tiny_model(str(tmp_path / "hf"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)


def _run_bench_e2e(hf, out, *options):
    """tools/bench_e2e.py at world 1 on the native engine: one warm-up and two measured steps of 4 prompts x 2
    samples, the greedy row timed once; `options` go before the config overrides."""
    return subprocess.run(
        [
            sys.executable,
            "tools/bench_e2e.py",
            "--hf-dir",
            hf,
            "--json",
            str(out),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--greedy-repeats",
            "1",
            *options,
            "actor.tp=1",
            "rollout.engine=native",
            "trainer.prompts_per_step=4",
            "rollout.n=2",
            "trainer.micro_batch_size=4",
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_bench_e2e_json_contract(tmp_path):
    out = tmp_path / "e2e.json"
    r = _run_bench_e2e(_tiny_llama(tmp_path), out)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(r.stdout[r.stdout.index("{") :]) == result  # the same object on stdout

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
    # from the process's start to the end of the first (warm-up) step: the build is part of it
    assert result["launch_to_first_step_s"] > result["build_s"] > 0
    assert positive(result["peak_memory"]["host_gib"]) and "gpu_gib" not in result["peak_memory"]


FAKE_PEER = '''#!{python}
"""Stands in for TRL: records when it ran, reports fixed step times."""
import json, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
with open({log!r}, "a") as f:
    f.write(f"{{time.time()}}\\n")
with open(out, "w") as f:
    json.dump({{"samples_per_s": 8 / 3.0, "step_s": [3.0, 3.5], "cpu_s_per_sample": 0.25, "generation": "fake"}}, f)
'''


@pytest.mark.slow
def test_rounds_alternate_ours_and_the_peer(tmp_path):
    """--rounds 2: ours, peer, peer, ours (ABBA); each round's ratio is the peer's median step time over
    ours in that round, the reported ratio their median; ours warms up once and runs every measured step."""
    hf = _tiny_llama(tmp_path)
    log = tmp_path / "peer_calls.txt"
    peer = tmp_path / "fake_peer"
    peer.write_text(FAKE_PEER.format(python=sys.executable, log=str(log)))
    peer.chmod(0o755)
    out = tmp_path / "e2e.json"
    r = _run_bench_e2e(
        hf, out, "--rounds", "2", "--peer", "trl", "--peer-python", str(peer), "--peer-generation", "transformers"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    calls = [float(t) for t in log.read_text().split()]
    steps = [json.loads(line) for line in open(result["metrics_jsonl"])]
    assert len(calls) == 2 and len(steps) == 1 + 2 * 2  # one warm-up, two measured steps per round
    # ABBA: round 0 ran ours before its peer, round 1 both peers came before ours' last steps
    assert [x["order"] for x in result["rounds"]] == ["ours, trl", "trl, ours"]
    assert calls[1] < os.path.getmtime(result["metrics_jsonl"])
    ours_rounds = [x["ours_step_s"] for x in result["rounds"]]
    assert ours_rounds == [result["step_s"][:2], result["step_s"][2:]]
    for x in result["rounds"]:
        assert x["peer_step_s"] == [3.0, 3.5]
        assert x["ratio"] == pytest.approx(3.25 / (sum(x["ours_step_s"]) / 2))
    assert result["ratio"] == pytest.approx(sum(x["ratio"] for x in result["rounds"]) / 2)
    assert result["peer"]["step_s"] == [3.0, 3.5, 3.0, 3.5]
    assert result["pooled_ratio"] == pytest.approx(result["samples_per_s"] / (8 / 3.25))


def test_rounds_need_the_peer_and_one_process():
    r = subprocess.run(
        [sys.executable, "tools/bench_e2e.py", "--hf-dir", "x", "--rounds", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--rounds 2 alternates with the peer" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("what", ["float16", "reward_model"])
def test_the_peer_refuses_work_it_cannot_match_before_building(tmp_path, what):
    """One line naming the value, exit 2, before the trainer is built (no result written)."""
    hf = _tiny_llama(tmp_path)
    if what == "float16":
        override, message = (
            "actor.dtype=float16",
            (
                "--peer trl runs actor.dtype=float32 or bfloat16 (TRL's "
                "bf16=True), not actor.dtype=float16: set one of those"
            ),
        )
    else:
        rm = make_tiny_model(
            str(tmp_path / "rm"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, reward=True
        )
        override, message = f"reward.model={rm}", "--peer trl compares rule-based rewards only"
    out = tmp_path / "e2e.json"
    r = subprocess.run(
        [
            sys.executable,
            "tools/bench_e2e.py",
            "--hf-dir",
            hf,
            "--json",
            str(out),
            "--peer",
            "trl",
            "actor.tp=1",
            "rollout.engine=native",
            override,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith(f"error: {message}") and not out.exists()
    assert "build_s" not in r.stdout


@pytest.mark.slow
def test_bench_placement_runs_all_four_and_reports_the_ratios(tmp_path):
    """tools/bench_placement.py (issue 36 item 6): colocated at W-1 and W, separate at W with staleness 0 and 1,
    through tools/bench_e2e.py --placement separate; the ratios are those of the runs' own numbers. W = 2 (the
    least that has a rollout rank and a training rank): 7 processes on the 2 cores where W = 3 took 11."""
    hf = _tiny_llama(tmp_path)
    out = tmp_path / "placement.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [
            sys.executable,
            "tools/bench_placement.py",
            "--hf-dir",
            hf,
            "--world",
            "2",
            "--tp",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
            "rollout.engine=native",
            "trainer.prompts_per_step=4",
            "rollout.n=2",
            "trainer.micro_batch_size=4",
            "rollout.max_new_tokens=4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [runs[n]["layout"]["world"] for n in ("colocated_small", "colocated", "separate_0", "separate_1")] == [
        1,
        2,
        2,
        2,
    ]
    assert runs["separate_1"]["placement"] == {
        "placement": "separate",
        "rollout_ranks": 1,
        "max_staleness": 1,
        "staleness": 1.0,
    }
    assert runs["separate_0"]["placement"]["staleness"] == 0.0 and "greedy_row" not in runs["separate_0"]
    wait = result["rollout_wait_s"]
    assert result["hidden_frac"] == pytest.approx(1 - wait["separate_1"] / wait["separate_0"])
    assert result["speedup_vs_colocated"] == pytest.approx(
        result["step_s"]["colocated"] / result["step_s"]["separate_1"]
    )
