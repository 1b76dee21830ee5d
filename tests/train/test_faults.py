"""Faults a run must report in one line, without losing or overwriting anything (issue 17, items 5,
6 and 11), on the tiny default (native engine):

- an unwritable trainer.output_dir or checkpoint.dir is refused at start-up (exit 2, one line, no
  model built, nothing created), not at the first write or save
- a user reward function that raises, returns NaN or the wrong count on one rank: that rank prints
  one line, once; every rank stops; exit 1; the output directory of an earlier run is untouched
  (config.yaml not replaced, no metrics.jsonl or TensorBoard events added)
- a resume that falls back past a corrupt checkpoint moves the superseded metrics rows aside (no
  step twice in metrics.jsonl); trainer.steps below the checkpoint's step warns instead of "done"
"""

import json
import os
import subprocess
import sys

import pytest

from remax_megatron.metrics import SUPERSEDED, MetricsLogger
from tests._dist import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = [sys.executable, "-m", "remax_megatron.launch", "--nproc_per_node=2"]
SHORT = ["rollout.engine=native", "trainer.eval_every=0", "logging.progress_bar=false"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env.pop("LOGLEVEL", None)
    return env


def _run(cmd, env=None):
    return subprocess.run(cmd, cwd=ROOT, env=env or _env(), capture_output=True, text=True, timeout=900)


def _train(out, *overrides, launcher=LAUNCH):
    """The job under `launcher`; launcher=None: torchrun's two ranks forked from the tests' warm fork
    server (tests/_dist.run_main), for what the ranks do rather than what the launcher reports."""
    argv = ["--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={out}", *SHORT, *overrides]
    if launcher is None:
        return run_main("remax_megatron.train", argv, 2, env=_env())
    return _run([*launcher, "-m", "remax_megatron.train", *argv])


def _metrics_steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


# ---- item 5: unwritable output directories, refused before any work --------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        # a path under a regular file: root cannot create it either (chmod would not stop root)
        (
            "trainer.output_dir={file}/run",
            "trainer.output_dir={file}/run cannot be created ({file} is a file, not a directory)",
        ),
        ("checkpoint.dir={file}", "checkpoint.dir={file} cannot be written ({file} is a file, not a directory)"),
        # sysfs refuses mkdir to root too (EPERM)
        (
            "checkpoint.dir=/sys/remax-checkpoints",
            "checkpoint.dir=/sys/remax-checkpoints cannot be created (PermissionError: Operation not permitted)",
        ),
    ],
)
def test_unwritable_output_is_refused_at_start_up(tmp_path, monkeypatch, override, message):
    """The start-up checks (load_config + check_inputs, what train.py runs first; its exit 2 and one
    line: tests/train/test_train_e2e.py) in this process: nothing written, no built-in model built."""
    from remax_megatron.config import load_config
    from remax_megatron.startup import check_inputs

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    monkeypatch.setenv("REMAX_CACHE", str(cache))
    with pytest.raises(ValueError) as refused:
        cfg = load_config(
            os.path.join(ROOT, "configs/tiny_cpu.yaml"),
            ["actor.tp=1", f"trainer.output_dir={out}", *SHORT, "trainer.steps=1", override.format(file=blocker)],
        )
        check_inputs(cfg, 1)
    assert str(refused.value) == f"{message.format(file=blocker)}: point it at a writable directory"
    assert not out.exists() and blocker.read_text() == "not a directory\n"
    assert (
        not [p for p in os.listdir(cache) if os.path.isfile(os.path.join(cache, p, "remax_builtin.json"))]
        if cache.exists()
        else True
    )  # no built-in model was built


# ---- item 6: user reward functions that go wrong -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_built():
    """The built-in actor built before the runs below: a run that builds it prints the build's own two lines
    (the first test of a fresh cache would see three lines, not the one it checks)."""
    from remax_megatron.builtin.models import resolve_model

    return resolve_model("builtin:tiny-arith", "actor.model")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, message",
    [
        ("raises", "raised ZeroDivisionError: division by zero (on prompt "),
        ("nan", "returned nan for prompt "),
        ("short", " values for "),
    ],
)
def test_bad_reward_function_is_one_line_from_its_rank(tmp_path, fn, message, tiny_built):
    """actor.tp=1, dp=2: the function fails on rank 1 only; rank 0 would otherwise wait in the next
    collective. An earlier run's files in the output directory stay as they were."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("# an earlier run's config\n")
    r = _train(out, "actor.tp=1", "trainer.steps=2", f"reward.functions=[tests.reward.faulty_rewards:{fn}]")
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"error: reward function 'tests.reward.faulty_rewards:{fn}'"), lines
    assert message in lines[0] and lines[0].endswith("(rank 1)"), lines
    assert sorted(os.listdir(out)) == ["config.yaml"]  # no metrics.jsonl, tensorboard/, checkpoints/
    assert (out / "config.yaml").read_text() == "# an earlier run's config\n"


# ---- item 11: metrics of a fallback resume, steps below the checkpoint ------------------------------


def test_first_record_moves_superseded_rows_aside(tmp_path):
    """Resumed at step 3 (e.g. after a corrupt step-4 checkpoint was skipped): rows 4-6 of the earlier
    attempt leave metrics.jsonl for metrics.superseded.jsonl, in order; nothing is lost."""
    out = tmp_path / "run"
    out.mkdir()
    old = [{"step": s, "loss": float(s)} for s in range(1, 7)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    started = []
    log = MetricsLogger(
        str(out), 10, tensorboard=False, progress_bar=False, on_first_record=lambda: started.append(True)
    )
    assert not started
    log.log({"step": 4, "loss": 40.0})
    log.log({"step": 5, "loss": 50.0})
    log.close()
    assert started == [True]
    assert _metrics_steps(out) == [1, 2, 3, 4, 5]
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["loss"] for line in f] == [1.0, 2.0, 3.0, 40.0, 50.0]
    with open(out / SUPERSEDED) as f:
        assert [json.loads(line) for line in f] == old[3:]


def test_logger_writes_nothing_before_the_first_record(tmp_path):
    out = tmp_path / "run"
    log = MetricsLogger(
        str(out),
        10,
        tensorboard=True,
        progress_bar=False,
        on_first_record=lambda: (out / "config.yaml").write_text("x"),
    )
    log.close()
    assert not out.exists()


@pytest.mark.slow
def test_fallback_resume_has_each_step_once_and_short_steps_warn(tmp_path):
    out = str(tmp_path / "run")
    r = _train(out, "trainer.steps=4", "checkpoint.save_every=2", "logging.tensorboard=false", launcher=None)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    shard = next(
        os.path.join(d, n)
        for d, _, names in os.walk(os.path.join(out, "checkpoints", "step_000004"))
        for n in sorted(names)
        if n.endswith(".distcp")
    )
    with open(shard, "r+b") as f:  # same size, other bytes: the checksum finds it
        f.write(b"\xff" * 64)
    r = _train(out, "trainer.steps=4", "logging.tensorboard=false", launcher=None)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "resumed from" in r.stdout and "step_000002 at step 2" in r.stdout
    assert _metrics_steps(out) == [1, 2, 3, 4]
    assert [json.loads(line)["step"] for line in open(os.path.join(out, SUPERSEDED))] == [3, 4]
    r = _train(out, "trainer.steps=3", "logging.tensorboard=false", launcher=None)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "done" not in r.stdout
    assert r.stderr.splitlines() == [
        "warning: the checkpoint resumed from is at step 4, past trainer.steps=3: "
        "nothing was trained; set trainer.steps above 4 to train on (or "
        "checkpoint.resume=none to start over)"
    ], r.stderr[-3000:]


@pytest.fixture
def builtin_model():
    """The tiny default's model built before the run: its one-time build writes to stderr."""
    from remax_megatron.builtin.models import ensure_builtin_model

    ensure_builtin_model("tiny-arith", verbose=False)


@pytest.mark.slow
def test_a_policy_that_collapses_is_warned_and_not_checkpointed(tmp_path, builtin_model):
    """optim.lr=1e3 on the warm-started default: the first update destroys the policy (entropy = ln vocab
    from step 2, rewards 0). One warning; the saves of the collapsed steps are refused, each said on
    stderr, and step 1's checkpoint stays the newest."""
    out = str(tmp_path / "run")
    r = _run(
        [
            sys.executable,
            "-m",
            "remax_megatron.train",
            "--config",
            "configs/tiny_cpu.yaml",
            "actor.tp=1",
            f"trainer.output_dir={out}",
            *SHORT,
            "trainer.steps=3",
            "optim.lr=1e3",
            "checkpoint.save_every=1",
            "logging.tensorboard=false",
        ]
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lines = r.stderr.splitlines()
    assert lines[0].startswith("warning: the policy collapsed to uniform at step 2: entropy 4.6"), r.stderr
    first = os.path.join(out, "checkpoints", "step_000001")
    assert lines[1:] == [
        f"warning: not saving step {s}: the policy has been collapsed to uniform since step 2 "
        f"(entropy at ln(vocab) = 4.615); the newest checkpoint stays {first}"
        for s in (2, 3)
    ], lines
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step_000001"
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000001"]
