"""A run's directory lock (remax_megatron/run_lock.py), in this process and in a killed one:

- a directory another holder locks is refused in one line naming the key, the path, host and pid;
  the refused call creates nothing and leaves the holder's lock file as it was
- a holder that was SIGKILLed blocks nothing: its leftover lock file is taken over
- release removes the lock files and the directories the lock created while they are empty
- one lock for two keys naming the same directory

The two runs into one directory, end to end: tests/launch/test_run_ownership.py.
"""

import os
import signal
import socket
import subprocess
import sys

import pytest

from remax_megatron.run_lock import LOCK_NAME, DirectoryInUse, RunLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_locked_directory_is_refused_naming_its_holder(tmp_path):
    out = tmp_path / "run"
    first = RunLock.acquire({"trainer.output_dir": str(out), "checkpoint.dir": str(out / "checkpoints")})
    held = {p: (p / LOCK_NAME).read_bytes() for p in (out, out / "checkpoints")}
    other = tmp_path / "other"
    with pytest.raises(DirectoryInUse) as refused:  # a second open file description: flock conflicts
        RunLock.acquire({"trainer.output_dir": str(other), "checkpoint.dir": str(out / "checkpoints")})
    line = str(refused.value)
    assert line.startswith(
        f"checkpoint.dir={out / 'checkpoints'} is in use by another run (host "
        f"{socket.gethostname()}, pid {os.getpid()}, since "
    ), line
    assert (
        line.endswith("): wait for it to end or stop it, or give this run another checkpoint.dir") and "\n" not in line
    )
    assert not other.exists()  # the refused call created nothing, even the directory it took first
    assert {p: (p / LOCK_NAME).read_bytes() for p in held} == held
    first.release()
    assert not out.exists()  # created by the lock and still empty: removed with it


def test_a_killed_holder_blocks_nothing(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from remax_megatron.run_lock import RunLock; "
            f"RunLock.acquire({{'trainer.output_dir': {str(out)!r}}}); print('held', flush=True); time.sleep(600)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryInUse, match=f"pid {holder.pid}, since"):
            RunLock.acquire({"trainer.output_dir": str(out)})
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_NAME).exists()  # left behind by the killed run
    (out / "metrics.jsonl").write_text("{}\n")  # the dead run's output stays
    lock = RunLock.acquire({"trainer.output_dir": str(out)})
    lock.release()
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]


def test_one_lock_for_one_directory_under_two_keys(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = RunLock.acquire({"trainer.output_dir": str(out), "checkpoint.dir": str(out) + "/"})
    (out / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]  # kept: it existed before and is not empty
