"""The first record's start-up timings (remax_megatron/startup_times.py)."""

import os
import subprocess
import sys
import time

import psutil

from remax_megatron.startup_times import StartupClock, launch_time


def test_parts_add_up_and_the_first_record_is_reported_once():
    clock = StartupClock()
    with clock.part("models"):
        time.sleep(0.02)
    with clock.part("models"):  # a part timed twice (actor, then reference) adds up
        time.sleep(0.02)
    assert clock.first_record() == {}  # no step has started yet
    clock.step_starts()
    first_start = clock.step_start
    clock.step_starts()  # later steps do not move start-up's end
    assert clock.step_start == first_start
    record = clock.first_record()
    assert record["time/startup/models_s"] >= 0.04
    assert record["time/launch_to_first_step_s"] >= record["time/startup_s"] >= record["time/startup/models_s"]
    assert record["time/startup/launch_s"] >= 0
    assert clock.first_record() == {}  # the first record only


def test_launch_is_the_torchrun_agent_start_for_a_worker(monkeypatch):
    me = psutil.Process()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launch_time() == me.create_time()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert launch_time() == me.parent().create_time()


def test_a_worker_counts_from_its_launcher():
    """A child started 1 s after its parent counts the parent's second (the launcher's start)."""
    code = "from remax_megatron.startup_times import StartupClock; print(StartupClock().parts['launch'])"
    env = dict(os.environ, TORCHELASTIC_RUN_ID="x")
    launcher = "import subprocess, sys, time; time.sleep(1.0); subprocess.run([sys.executable, '-c', sys.argv[1]])"
    out = subprocess.run(
        [sys.executable, "-c", launcher, code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert float(out) >= 1.0, out
