"""A run owns its directories, and its processes die with it (issue 31 items 1, 4, 5, 6, 11), through
remax_megatron.launch with 2 gloo workers on a tiny random Llama (native engine):

- two runs into one output directory: the second is refused in one line naming the first's host and
  rank-0 pid, before it writes anything (the first, frozen meanwhile, has byte-identical files), and
  the first then finishes normally
- SIGKILL of rank 0 in the middle of a save (its forked checkpoint writer frozen mid-write): the job
  exits with the killed rank's line, no process of the job is left (the writer died with its rank),
  the surviving rank's error is the usual one line, not a traceback; the next run is not blocked by
  the dead run's lock, refuses a resume with another model of the same shapes in one line (writing
  nothing), and with the right model removes the unfinished save, says so, and resumes
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.launch.test_stop_signals import _job, _session, _wait_for_steps
from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = [sys.executable, "-m", "remax_megatron.launch", "--nproc_per_node=2"]
SHAPE = dict(hidden=32, layers=2, heads=2, kv_heads=2, ffn=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {seed: make_tiny_model(str(root / f"llama{seed}"), "llama", seed=seed, **SHAPE) for seed in (1, 2)}


def _cmd(model, out, *overrides, launcher=LAUNCH):
    return [
        *launcher,
        "-m",
        "remax_megatron.train",
        f"actor.model={model}",
        "data.train=builtin:arith",
        "data.chat_template=false",
        "rollout.engine=native",
        "reward.functions=[exact_match,length_penalty]",
        "reward.length_limit=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=2",
        "trainer.eval_every=0",
        "optim.lr=1e-3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"trainer.output_dir={out}",
        *overrides,
    ]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOGLEVEL", None)
    return env


def _snapshot(top):
    return {
        os.path.relpath(os.path.join(d, n), top): open(os.path.join(d, n), "rb").read()
        for d, _, names in os.walk(top)
        for n in names
    }


def _holder(out):
    with open(os.path.join(out, ".remax-run.lock")) as f:
        return json.load(f)


def _metrics_steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_is_refused_and_the_first_finishes(models, tmp_path):
    out = str(tmp_path / "run")
    with _job(_cmd(models[1], out, "trainer.steps=8", "checkpoint.save_every=2", "trainer.seed=0")) as first:
        _wait_for_steps(first, out)
        holder = _holder(out)
        job = _freeze(first.pid)  # frozen: any change to its files from here on would be the second run's
        assert holder["pid"] in job  # rank 0 of the first run holds the lock
        try:
            before = _snapshot(out)
            second = subprocess.run(
                _cmd(models[1], out, "trainer.steps=8", "trainer.seed=1"),
                cwd=ROOT,
                env=_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            after = _snapshot(out)
        finally:
            for pid in job:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:  # it was exiting when frozen (a CI run saw one gone): nothing to resume
                    pass
        stdout, stderr = first.communicate(timeout=300)
    assert second.returncode == 2, (second.stdout + second.stderr)[-3000:]
    assert second.stderr.splitlines() == [
        f"error: trainer.output_dir={out} is in use by another run (host {holder['host']}, pid {holder['pid']}, since "
        f"{holder['since']}): wait for it to end or stop it, or give this run another trainer.output_dir"
    ], second.stderr
    assert after == before
    assert first.returncode == 0, (stdout + stderr)[-3000:]
    assert f"; outputs in {out} (metrics.jsonl" in stdout
    assert _metrics_steps(out) == list(range(1, 9))
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step_000008"
    assert not os.path.exists(os.path.join(out, ".remax-run.lock"))  # released at the end


def _freeze(pid):
    """SIGSTOP the process `pid` and its descendants, over again until a look at the children of the
    stopped ones, taken once all of them are stopped, finds no new one (one may fork between our look
    and its stop: a CI run saw a checkpoint writer forked then write into the frozen run); returns
    their pids."""
    stopped = []
    while True:
        fresh = [pid] if not stopped else []
        for p in [psutil.Process(q) for q in stopped or [pid]]:
            try:
                fresh += [c.pid for c in p.children(recursive=True) if c.pid not in stopped]
            except psutil.NoSuchProcess:
                pass
        fresh = [q for q in dict.fromkeys(fresh) if q not in stopped]
        if not fresh and stopped:
            return stopped  # every one was stopped before this look: none can fork any more
        for q in fresh:
            try:
                os.kill(q, signal.SIGSTOP)
                stopped.append(q)
            except ProcessLookupError:
                pass
        # kill() returns before the process stops: wait until each one is stopped (state T)
        while any(_running(q) for q in stopped):
            time.sleep(0.01)


def _forked_writer(child, rank):
    """Whether `child` is a fork of `rank` (its command line) that has run the fork hook (it ignores
    SIGINT, the hook's last signal: remax_megatron.processes), i.e. is writing. Frozen before its hook
    ran, a child would have no parent-death signal yet: a state no real writer stays in (it runs the
    hook first thing, and exits there when its parent is already gone)."""
    try:
        with open(f"/proc/{child.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        return child.cmdline() == rank.cmdline() and bool(ignored & (1 << (signal.SIGINT - 1)))
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
        return False


def _running(pid):
    """Whether any thread of `pid` is not stopped yet. The process's own state is its main thread's: a
    checkpoint writer thread still finishing a file's creation showed up in the frozen run's files."""
    try:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(state not in ("T", "t", "Z", "X") for state in states)


def _error_lines(log_dir, rank):
    """The one-line error a worker left for the launcher (torch's per-worker reply file)."""
    lines = []
    for d, _, names in os.walk(log_dir):
        if os.path.basename(d) == str(rank) and "error.json" in names:
            with open(os.path.join(d, "error.json")) as f:
                lines.append(json.load(f)["message"])
    return lines


def _stderr_of(log_dir, rank):
    return "".join(
        open(os.path.join(d, "stderr.log")).read()
        for d, _, names in os.walk(log_dir)
        if os.path.basename(d) == str(rank) and "stderr.log" in names
    )


@pytest.mark.slow
def test_rank_0_killed_mid_save_leaves_no_process_and_the_next_run_cleans_up(models, tmp_path):
    out, logs = str(tmp_path / "run"), str(tmp_path / "logs")
    launcher = [*LAUNCH, f"--log-dir={logs}", "--redirects=2"]  # each worker's stderr in its own file
    with _job(_cmd(models[1], out, "trainer.steps=200", "checkpoint.save_every=1", launcher=launcher)) as job:
        _wait_for_steps(job, out)
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(out, "checkpoints", "latest")):  # one complete checkpoint first
            assert time.time() < deadline and job.poll() is None, "no checkpoint saved"
            time.sleep(0.05)
        rank0 = psutil.Process(_holder(out)["pid"])
        workers = [p.pid for p in psutil.Process(job.pid).children()]
        writer, deadline = None, time.time() + 300
        while writer is None:  # a forked checkpoint writer of rank 0, frozen mid-write
            assert time.time() < deadline and job.poll() is None, "no checkpoint writer seen"
            for child in rank0.children():
                if _forked_writer(child, rank0):
                    child.send_signal(signal.SIGSTOP)
                    writer = child.pid
                    break
        assert any(n.startswith(".tmp-step_") for n in os.listdir(os.path.join(out, "checkpoints")))
        rank0.kill()
        job.wait(timeout=300)
        deadline = time.time() + 30
        while any(_session(sid) for sid in [job.pid, *workers]) and time.time() < deadline:
            time.sleep(0.2)
        left = {sid: _session(sid) for sid in [job.pid, *workers] if _session(sid)}
        for pid in (p for pids in left.values() for p in pids):
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of the job outlived it: {left} (the frozen writer was {writer})"
        _, stderr = job.communicate(timeout=30)
    assert job.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert stderr.splitlines()[-1] == f"error: rank 0 (pid {rank0.pid}) died from SIGKILL", stderr[-3000:]
    # the survivor: its one line (the save's collective broke), no traceback
    lines = _error_lines(logs, 1)
    assert len(lines) == 1, (lines, _stderr_of(logs, 1)[-3000:])
    line = lines[0]
    assert line.startswith("error: step ") and ", stage 'checkpoint' failed on rank 1: " in line, line
    assert "Traceback" not in _stderr_of(logs, 1), _stderr_of(logs, 1)[-3000:]
    stale = [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith(".tmp-step_")]
    assert len(stale) == 1
    newest = open(os.path.join(out, "checkpoints", "latest")).read()
    done = int(newest.split("_")[1])

    # The same directory with another model of the same shapes: refused in one line, nothing written (the
    # dead run's lock files, taken over and released, are all that goes).
    before = {k: v for k, v in _snapshot(out).items() if not k.endswith(".remax-run.lock")}
    r = subprocess.run(
        _cmd(models[2], out, f"trainer.steps={done + 2}"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert r.stderr.splitlines() == [
        f"error: checkpoint {out}/checkpoints/{newest} was trained from actor.model={models[1]}, and actor.model="
        f"{models[2]} is another model (its weights differ): resume with actor.model={models[1]}, start fresh with "
        "checkpoint.resume=none (or another trainer.output_dir), or set checkpoint.allow_model_change=true to train "
        "on the checkpoint's weights with this model's config and tokenizer"
    ], r.stderr[-3000:]
    assert _snapshot(out) == before

    # The right model: the dead run's lock blocks nothing, its unfinished save goes, the run resumes.
    r = subprocess.run(
        _cmd(models[1], out, f"trainer.steps={done + 2}"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"removed {out}/checkpoints/{stale[0]}: the unfinished save of an earlier run" in r.stdout, r.stdout
    assert f"resumed from {out}/checkpoints/{newest} at step {done}" in r.stdout, r.stdout
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith(".tmp-")]
    assert _metrics_steps(out) == list(range(1, done + 3))
