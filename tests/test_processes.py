"""A rank's forked children (megatron's checkpoint writers are forked with multiprocessing's "fork"
context) die with it, and its stop signals are the rank's (remax_megatron/processes.py):

- the child ignores SIGTERM (a step-wide stop signal must not kill a writer mid-save) and dies at
  once when its parent is SIGKILLed, instead of living on re-parented to init
- the child does not keep the parent's directory lock: the next run takes it
- a second SIGINT stops the process at once with one line (exit 130), the first one only sets the flag

SIGKILL of a real rank mid-save: tests/launch/test_run_ownership.py.
"""

import os
import signal
import subprocess
import sys
import time

from remax_megatron.run_lock import LOCK_NAME, RunLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARENT = """
import multiprocessing, sys, time
from remax_megatron.processes import children_die_with_parent, preemption_flag
from remax_megatron.run_lock import RunLock

def writer(ready):  # what a forked checkpoint writer would do; its fork hook ran before this line
    ready.set()
    time.sleep(600)


preemption_flag()
children_die_with_parent()
RunLock.acquire({"trainer.output_dir": sys.argv[1]})
ctx = multiprocessing.get_context("fork")
ready = ctx.Event()
child = ctx.Process(target=writer, args=(ready,))
child.start()
ready.wait(60)
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_child_dies_with_its_parent_and_leaves_the_lock(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        child = int(parent.stdout.readline())
        open_files = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
        assert not [f for f in open_files if f.endswith(LOCK_NAME)], "the child holds the run's lock file open"
        with open(f"/proc/{child}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # not the trainer's handlers
            assert ignored & (1 << (sig - 1)), f"the child does not ignore {sig.name}"
        os.kill(child, signal.SIGTERM)
        time.sleep(0.3)
        assert _alive(child), "the child died of SIGTERM: stopping is its rank's decision"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 5
        while _alive(child) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the forked child outlived its parent"
    finally:  # nothing left behind by a failure
        parent.kill()
        parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
    RunLock.acquire({"trainer.output_dir": str(tmp_path / "run")}).release()


INTERRUPTED = """
import os, signal, sys, time
from remax_megatron.processes import preemption_flag

flag = preemption_flag()
os.kill(os.getpid(), signal.SIGINT)
print("after one:", flag.requested, flag.signal_name, flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("still running", flush=True)
"""


def test_a_second_sigint_stops_at_once_in_one_line():
    r = subprocess.run(
        [sys.executable, "-c", INTERRUPTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "REMAX_LAUNCHER")},
    )
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert r.stdout == "after one: True SIGINT\n", r.stdout
    assert r.stderr.splitlines() == [
        "error: stopped by a second SIGINT, without saving: the newest complete "
        "checkpoint stays; rerun with checkpoint.resume=auto to continue from it"
    ]
