"""Stopping a job (issue 17, items 2 and 10; issue 31 items 9, 10), through remax_megatron.launch with 2
gloo workers on the tiny default (native engine):

- SIGUSR1 / SIGTERM sent to the launcher, or to one rank, and Ctrl-C (SIGINT to the launcher's process
  group): exit 0, a checkpoint of the last finished step that validates (and resumes), and no process
  of the job left (its whole session is checked)
- plain torchrun killed by SIGUSR1 (what it does with that signal): its orphaned workers still save
  at the step boundary and exit (parent-death signal), instead of training on
- exit codes: an input error is the worker's one line and exit 2, nothing after it; a rank killed by
  SIGKILL is one line naming it, exit 137; a MASTER_PORT in use is one line naming it, exit 2
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from remax_megatron.launch import LAUNCHER_ENV, _without_ours, job_exit, report_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = [sys.executable, "-m", "remax_megatron.launch"]
TORCHRUN = [os.path.join(os.path.dirname(sys.executable), "torchrun")]


@pytest.fixture(autouse=True)
def builtin_model(request):
    """The tiny default's model built before any job (the slow tests here): its one-time build writes to
    stderr, which these tests require to be empty (so each passes alone too). The fast tests need no
    model: they do not wait for its build (a minute on 2 cores)."""
    if request.node.get_closest_marker("slow"):
        from remax_megatron.builtin.models import ensure_builtin_model

        ensure_builtin_model("tiny-arith", verbose=False)


def _cmd(launcher, out, *overrides):
    return [
        *launcher,
        "--nproc_per_node=2",
        "-m",
        "remax_megatron.train",
        "--config",
        "configs/tiny_cpu.yaml",
        "rollout.engine=native",
        "trainer.eval_every=0",
        "checkpoint.save_every=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"trainer.output_dir={out}",
        *overrides,
    ]


@contextlib.contextmanager
def _job(cmd):
    """The job in a session of its own: every process of it (launcher, workers, their helpers) has
    the launcher's pid as session and process-group id. Whatever a failed test leaves is killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOGLEVEL", None)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        yield proc
    finally:
        if _session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _session(sid: int) -> list[int]:
    """pids of live (not zombie) processes in session `sid`."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            pids.append(int(name))
    return pids


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _wait_for_steps(proc, out, steps=1, timeout=900):  # the first run of a test session builds the model
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + timeout
    while not (os.path.exists(path) and len(open(path).readlines()) >= steps):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no training step in time"
        time.sleep(0.2)


def _workers(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def _assert_saved_last_step(out):
    from remax_megatron.checkpoint import validate

    done = _metrics(out)[-1]["step"]
    ckpt = os.path.join(out, "checkpoints", open(os.path.join(out, "checkpoints", "latest")).read().strip())
    assert ckpt.endswith(f"step_{done:06d}"), (ckpt, done)  # the last finished step, nothing lost
    validate(ckpt)  # complete: manifest, sizes, checksums
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith(".tmp-")]
    return done


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, sig",
    [
        ("launcher", signal.SIGUSR1),
        ("launcher", signal.SIGTERM),
        ("rank", signal.SIGUSR1),
        ("rank", signal.SIGTERM),
        ("terminal", signal.SIGINT),
    ],
)
def test_stop_signal_saves_and_exits_0_with_nothing_left(tmp_path, target, sig):
    """target "terminal": Ctrl-C, SIGINT to the launcher's process group as a terminal sends it (the
    workers run in sessions of their own: they get it from the launcher)."""
    out = str(tmp_path / "run")
    with _job(_cmd(LAUNCH, out, "trainer.steps=200")) as proc:
        _wait_for_steps(proc, out)
        if target == "terminal":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid if target == "launcher" else _workers(proc.pid)[-1], sig)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, (stdout + stderr)[-3000:]
    assert stderr == "", stderr[-3000:]
    # rank 0 prints the line; naming the signal that reached another rank needs the trainer to share it
    assert f"preempted ({sig.name})" in stdout, stdout
    assert _session(proc.pid) == []
    done = _assert_saved_last_step(out)
    if (target, sig) == ("launcher", signal.SIGUSR1):  # and it resumes where it stopped
        r = subprocess.run(
            _cmd(LAUNCH, out, f"trainer.steps={done + 1}"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        assert f"resumed from {out}/checkpoints/step_{done:06d} at step {done}" in r.stdout
        assert [m["step"] for m in _metrics(out)] == list(range(1, done + 2))


@pytest.mark.slow
def test_plain_torchrun_killed_by_sigusr1_leaves_no_worker_training(tmp_path):
    """torchrun does not handle SIGUSR1 and dies of it; the workers get SIGTERM from the kernel
    (PR_SET_PDEATHSIG) and stop at the step boundary with a checkpoint, instead of training on."""
    out = str(tmp_path / "run")
    with _job(_cmd(TORCHRUN, out, "trainer.steps=200")) as proc:
        _wait_for_steps(proc, out)
        os.kill(proc.pid, signal.SIGUSR1)
        stdout, _ = proc.communicate(timeout=300)  # the workers hold stdout until they exit
        assert proc.returncode == -signal.SIGUSR1
        deadline = time.time() + 60
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert _session(proc.pid) == []
    assert "preempted (SIGTERM)" in stdout
    _assert_saved_last_step(out)


@pytest.mark.slow
def test_input_error_is_the_workers_line_and_exit_2(tmp_path):
    r = subprocess.run(
        _cmd(LAUNCH, str(tmp_path / "run"), "actor.tpp=2"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        "error: unknown config key 'actor.tpp'; did you mean actor.tp? "
        "(`python -m remax_megatron.train --help` lists every key)"
    ], r.stderr[-3000:]


@pytest.mark.slow
def test_killed_rank_is_one_line_naming_it(tmp_path):
    out = str(tmp_path / "run")
    with _job(_cmd(LAUNCH, out, "trainer.steps=200")) as proc:
        _wait_for_steps(proc, out)
        victim = _workers(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert stderr.splitlines()[-1].startswith("error: rank ") and f"(pid {victim}) died from SIGKILL" in stderr
    assert _session(proc.pid) == []


def test_launcher_keeps_sigterm_and_sigusr1_for_itself():
    assert _without_ours("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGHUP,SIGQUIT"
    assert _without_ours("SIGUSR1, SIGUSR2,SIGTERM") == "SIGUSR2"


def test_a_killed_rank_is_the_cause_even_when_its_peer_failed_in_the_same_poll(tmp_path):
    """The race CI hit once: rank 1 SIGKILLed, rank 0 exits 1 on "Connection reset by peer", and
    torchrun collects both; the job names the killed rank (exit 137), not the peer's exit 1."""

    def failure(rank, pid, exitcode):
        return ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file=str(tmp_path / "none"))

    both = {0: failure(0, 100, 1), 1: failure(1, 101, -signal.SIGKILL)}
    assert job_exit(both) == (137, "error: rank 1 (pid 101) died from SIGKILL")
    assert job_exit({0: failure(0, 100, 2), 1: failure(1, 101, 2)}) == (2, None)  # no line left by a worker
    assert job_exit({1: failure(1, 101, 1), 3: failure(3, 103, 2)}) == (1, None)  # the lowest failed rank
    # rank 1 killed; the agent then stopped rank 0 (SIGTERM, or SIGKILL after its grace): rank 1 is named
    for stop in (-signal.SIGTERM, -signal.SIGKILL):
        assert job_exit({1: failure(1, 101, -signal.SIGKILL), 0: failure(0, 100, stop)}, {100}) == (
            137,
            "error: rank 1 (pid 101) died from SIGKILL",
        )
    # rank 0 failed on its own; rank 1, stuck in a collective, was SIGKILLed by the agent: exit 1, rank 0's line
    assert job_exit({0: failure(0, 100, 1), 1: failure(1, 101, -signal.SIGKILL)}, {101}) == (1, None)


def test_the_line_comes_from_a_rank_that_left_it_even_when_the_printing_rank_was_stopped(tmp_path, monkeypatch):
    """The race CI hit once (exit 2, no line): rank 1 refused the input and exited while rank 0 was
    still importing; the agent stopped rank 0 before it printed. Every rank holding the line leaves
    it in its reply file; the launcher prints the lowest failed rank's one."""
    line = "error: unknown config key 'actor.tpp'; did you mean actor.tp?"
    monkeypatch.setenv(LAUNCHER_ENV, "1")
    for rank, printer, same in ((1, False, True), (2, False, False), (3, True, False)):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"{rank}.json"))
        report_error(f"{line} (from {rank})", printer=printer, same_on_every_rank=same)
    assert not (tmp_path / "2.json").exists()  # a rank whose line is not the report leaves none

    def failure(rank, exitcode):
        return ProcessFailure(
            local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(tmp_path / f"{rank}.json")
        )

    stopped = {0: failure(0, -signal.SIGTERM), 1: failure(1, 2)}
    assert job_exit(stopped, {100}) == (2, f"{line} (from 1)")
    assert job_exit({2: failure(2, 1), 3: failure(3, 1)}) == (1, f"{line} (from 3)")
    assert job_exit({2: failure(2, 1)}) == (1, None)  # no line left: its traceback is on stderr
    # a reward error: rank 2 exits at once ("failed on another rank", no line), the agent stops
    # rank 3, which had written the report and exits 1 itself
    assert job_exit({2: failure(2, 1), 3: failure(3, 1)}, {103}) == (1, f"{line} (from 3)")


def test_outside_the_launcher_only_the_printing_rank_prints(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "reply.json"))  # plain torchrun sets it too
    report_error("error: a", printer=False, same_on_every_rank=True)
    report_error("error: b", printer=True, same_on_every_rank=True)
    assert capsys.readouterr().err == "error: b\n"
    assert not (tmp_path / "reply.json").exists()


@pytest.fixture
def busy_port():
    """A port another process listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_master_port_in_use_is_one_line_naming_it(busy_port, tmp_path):
    """The launcher's rendezvous store (torchrun's agent hosts it) and a trainer started without
    torchrun (MASTER_PORT exported): exit 2 and one line naming MASTER_PORT and --master_port, not
    torch's EADDRINUSE traceback."""
    line = (
        f"error: MASTER_PORT {busy_port} is already in use on this host (EADDRINUSE): another job listens "
        "there; give this one a free port (torchrun / remax_megatron.launch --master_port=N, or MASTER_PORT=N)"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOGLEVEL", None)
    r = subprocess.run(
        [*LAUNCH, "--nproc_per_node=1", f"--master_port={busy_port}", "-m", "json.tool", "/dev/null"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (r.returncode, r.stderr.splitlines()) == (2, [line]), r.stderr[-3000:]
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from remax_megatron.parallel import init_distributed\n"
            "try:\n    init_distributed(1)\nexcept ValueError as e:\n    print(f'error: {e}')",
        ],
        cwd=ROOT,
        env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy_port), WORLD_SIZE="1", RANK="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.stdout.splitlines() == [line], (r.stdout + r.stderr)[-3000:]
