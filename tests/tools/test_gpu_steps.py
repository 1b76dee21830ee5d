"""tools/gpu_steps.py (tools/gpu_check.sh's scheduler) with fake steps: order, one deadline, optional steps
skipped when they do not fit, a mandatory step that fails, times out or cannot run fails the check."""

import json
import os
import subprocess
import sys
import time

import pytest

from tools import gpu_steps
from tools.gpu_steps import Step, run_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _statuses(summary):
    return [(s["name"], s["status"]) for s in summary["steps"]]


def test_steps_run_in_order_and_their_results_land_in_the_json(tmp_path):
    order = tmp_path / "order"
    res = tmp_path / "res.json"
    steps = [
        Step("a", f"echo a >> {order}", 1, 5, True),
        Step("b", ["bash", "-c", f"echo b >> {order}; echo '{{\"x\": 3}}' > {res}"], 1, 5, False, {"r": str(res)}),
        Step("c", f"echo c >> {order}", 1, 5, True),
    ]
    summary = run_steps(steps, 30, str(tmp_path / "out"))
    assert order.read_text().split() == ["a", "b", "c"]
    assert summary["ok"] and _statuses(summary) == [("a", "passed"), ("b", "passed"), ("c", "passed")]
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert written["results"] == {"b": {"r": {"x": 3}}} and written["ok"]
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert log.index("=== a:") < log.index("=== b:") < log.index("=== c:")


def test_an_optional_step_that_does_not_fit_is_skipped_and_the_next_one_runs(tmp_path):
    steps = [
        Step("must", "sleep 0.3", 0.3, 5, True),
        Step("big", "touch big", 10, 20, False),
        Step("small", "true", 0.2, 5, False),
    ]
    summary = run_steps(steps, 2, str(tmp_path))
    assert summary["ok"] and _statuses(summary) == [("must", "passed"), ("big", "skipped"), ("small", "passed")]
    assert "does not fit" in summary["steps"][1]["reason"] and not os.path.exists(os.path.join(ROOT, "big"))


def test_each_step_gets_at_most_the_time_left_and_a_mandatory_overrun_fails(tmp_path):
    # the second step would take 30 s and is allowed 60: the deadline (2 s) cuts it, its process group killed
    steps = [Step("quick", "true", 0.1, 5, True), Step("slow", "sleep 30 & sleep 30; wait", 1, 60, True)]
    start = time.monotonic()
    summary = run_steps(steps, 2, str(tmp_path))
    assert time.monotonic() - start < 10
    slow = summary["steps"][1]
    assert slow["status"] == "timed_out" and slow["rc"] == 124 and slow["timeout_s"] <= 2
    assert not summary["ok"] and summary["failed_mandatory"] == ["slow"]


def test_a_mandatory_step_that_does_not_fit_fails_and_one_past_the_deadline_does_not_run(tmp_path):
    steps = [
        Step("over", "sleep 5", 3, 10, True),  # estimate 3 s > 1 s left: runs in the time left, and overruns
        Step("after", "true", 0.1, 5, True),  # nothing left: not run
        Step("optional", "true", 0.1, 5, False),
    ]
    summary = run_steps(steps, 1, str(tmp_path))
    assert _statuses(summary) == [("over", "timed_out"), ("after", "not_run"), ("optional", "not_run")]
    assert "over its estimate" in summary["steps"][0]["reason"]
    assert not summary["ok"] and summary["failed_mandatory"] == ["over", "after"]


def test_a_failing_optional_step_is_recorded_and_does_not_fail_the_check(tmp_path):
    summary = run_steps([Step("m", "true", 0.1, 5, True), Step("o", "false", 0.1, 5, False)], 10, str(tmp_path))
    assert summary["ok"] and summary["steps"][1]["status"] == "failed" and summary["steps"][1]["rc"] == 1


def _cli(tmp_path, steps, *flags):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(steps))
    return subprocess.run(
        [sys.executable, "tools/gpu_steps.py", "--steps", str(path), "--out", str(tmp_path / "out"), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_command_exits_non_zero_when_a_mandatory_step_fails(tmp_path):
    steps = [
        {"name": "ok", "command": "true", "estimate_s": 0.1, "limit_s": 5, "mandatory": True},
        {"name": "bad", "command": ["false"], "estimate_s": 0.1, "limit_s": 5, "mandatory": True},
    ]
    r = _cli(tmp_path, steps, "--deadline", "20")
    assert r.returncode == 1, r.stderr
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert written["failed_mandatory"] == ["bad"] and not written["ok"]
    steps[1]["command"] = ["true"]
    assert _cli(tmp_path, steps, "--deadline", "20").returncode == 0


def test_plan_runs_nothing_and_says_when_a_mandatory_step_does_not_fit(tmp_path):
    marker = tmp_path / "ran"
    steps = [{"name": "m", "command": f"touch {marker}", "estimate_s": 50, "limit_s": 60, "mandatory": True}]
    r = _cli(tmp_path, steps, "--plan", "--deadline", "100")
    assert r.returncode == 0 and "fits" in r.stdout and not marker.exists()
    r = _cli(tmp_path, steps, "--plan", "--deadline", "10")
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout and not marker.exists()


def test_the_gpu_checks_own_plan_fits_its_mandatory_steps_in_priority_order():
    steps = gpu_steps.default_steps("python3", "/tmp/w")
    rows = gpu_steps.plan(steps, gpu_steps.DEADLINE_S)
    mandatory = [r["name"] for r in rows if r["mandatory"]]
    assert mandatory == ["env", "tests", "train", "peer", "kernels"]
    assert all(r["fits"] for r in rows if r["mandatory"])
    assert [r["mandatory"] for r in rows] == sorted((r["mandatory"] for r in rows), reverse=True)
    peer = next(s for s in steps if s.name == "peer").command
    for flag in ("--peer trl", "--hidden 2048", "--layers 16", "--heads 16", "--kv-heads 8", "--ffn 5632"):
        assert flag in peer, flag
    assert "--vocab 32003" in peer and "rollout.n=4" in peer and "trainer.prompts_per_step=32" in peer


def test_a_step_whose_estimate_exceeds_its_limit_is_refused():
    with pytest.raises(ValueError, match="estimate_s=9"):
        Step("x", "true", 9, 5)


def test_gpu_check_sh_parses_and_runs_the_scheduler():
    subprocess.run(["bash", "-n", "tools/gpu_check.sh"], cwd=ROOT, check=True)
    subprocess.run(["bash", "-n", "tools/fetch_gpu_wheels.sh"], cwd=ROOT, check=True)
    text = open(os.path.join(ROOT, "tools", "gpu_check.sh")).read()
    assert "tools/gpu_steps.py" in text
