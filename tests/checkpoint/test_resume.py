"""Checkpoints end to end (torchrun, 2 gloo processes, tiny random Llama, builtin:arith):

- exact resume: 6 steps straight == 3 steps + resume for 3 (bitwise metrics on CPU); bf16 with fp32
  main weights: 4 == 2 + 2
- resume at another layout (TP=2 -> PP=2) for 3 steps: losses, grad norms and final weights equal the
  straight run's (optimizer state, scheduler and data order resharded)
- SIGTERM mid-run: exit 0 after a checkpoint at a consistent step; the resumed run continues the data order
- a truncated shard / missing manifest: error naming the file; resume=auto falls back with a warning
- SIGKILL of one rank: the job exits non-zero within the timeout
- a checkpoint written by a newer megatron-core than the installed one: refused in one line at resume
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests._ckpt import max_difference, saved_weights
from tests._dist import run_main
from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TIMING = ("time/", "throughput/", "memory/", "perf/")  # run-dependent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        str(tmp_path_factory.mktemp("m") / "llama"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, seed=3
    )


def _args(model_dir, out, *extra):
    return [
        "-m",
        "remax_megatron.train",
        f"actor.model={model_dir}",
        "actor.tp=2",
        "data.train=builtin:arith",
        "data.chat_template=false",
        "rollout.engine=native",  # head_dim 16: vLLM's CPU attention refuses it
        # A random model never answers right: the length penalty gives non-zero advantages, so the
        # weights and Adam state really change between checkpoints.
        "reward.functions=[exact_match,length_penalty]",
        "reward.length_limit=2",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=4",
        "trainer.eval_every=0",
        "optim.lr=1e-3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


def _launch(args, nproc=2, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        [TORCHRUN, f"--nproc_per_node={nproc}", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _train(args, nproc=2):
    """torchrun's ranks forked from the tests' warm fork server (tests/_dist.run_main); the signal tests
    below launch the real command."""
    assert args[:2] == ["-m", "remax_megatron.train"], args[:2]
    r = run_main(
        "remax_megatron.train", args[2:], nproc, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _strip(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


@pytest.fixture(scope="module")
def straight(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    _train(_args(model_dir, out, "trainer.steps=6", "checkpoint.save_every=3", "checkpoint.keep=5"))
    return out


@pytest.mark.slow
def test_resume_is_exact(model_dir, straight, tmp_path):
    out = str(tmp_path / "run")
    _train(_args(model_dir, out, "trainer.steps=3"))
    _train(_args(model_dir, out, "trainer.steps=6", "checkpoint.resume=auto"))
    resumed, full = _strip(_metrics(out)), _strip(_metrics(straight))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    # Real updates on both sides of the resume point (a step whose samples all score like their greedy
    # answer has zero advantage and no gradient: step 3 of this seed).
    norms = [r["grad_norm"] for r in full]
    assert any(g > 0 for g in norms[:3]) and all(g > 0 for g in norms[3:]), norms
    assert resumed == full  # bitwise: every metric of steps 1-6


@pytest.mark.slow
def test_bf16_resume_restores_fp32_main_weights(model_dir, tmp_path):
    """bf16 parameters with fp32 main weights: the main weights are in the checkpoint (not re-derived
    from the rounded bf16 values), so resuming the straight run's step-2 checkpoint repeats its
    steps 3 and 4 bitwise."""
    bf16 = ["actor.dtype=bfloat16", "checkpoint.save_every=2"]
    straight, run = str(tmp_path / "straight"), str(tmp_path / "run")
    _train(_args(model_dir, straight, "trainer.steps=4", *bf16))
    _train(_args(model_dir, run, "trainer.steps=4", f"checkpoint.resume={straight}/checkpoints/step_000002", *bf16))
    resumed, full = _strip(_metrics(run)), _strip(_metrics(straight))
    assert [r["step"] for r in resumed] == [3, 4] and resumed == full[2:]


@pytest.mark.slow
def test_resume_at_another_layout(model_dir, straight, tmp_path):
    """TP=2 checkpoint of step 3, resumed at PP=2 for 3 more steps: the losses and grad norms of steps 4-6
    (each step's loss comes from the forward BEFORE its update, so steps 5 and 6 see the resharded Adam
    state, scheduler and data order at work) and the final weights match the straight TP=2 run."""
    out = str(tmp_path / "pp2")
    ckpt = os.path.join(straight, "checkpoints", "step_000003")
    args = _args(model_dir, out, "trainer.steps=6", f"checkpoint.resume={ckpt}", "actor.pp=2")
    _train([a if a != "actor.tp=2" else "actor.tp=1" for a in args])
    resumed, expected = _metrics(out), _metrics(straight)[3:]
    assert [r["step"] for r in resumed] == [4, 5, 6] == [r["step"] for r in expected]
    for got, want in zip(resumed, expected):
        assert abs(got["loss"] - want["loss"]) < 1e-5, (got["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) < 1e-4 * want["grad_norm"], got["step"]
        assert got["reward/sampled_mean"] == want["reward/sampled_mean"]
        assert (got["data/epoch"], got["data/position"]) == (want["data/epoch"], want["data/position"])
    final = saved_weights(os.path.join(straight, "checkpoints", "step_000006"))
    moved = max_difference(final, saved_weights(ckpt))  # what the last 3 steps changed
    worst = max_difference(saved_weights(os.path.join(out, "checkpoints", "step_000006")), final)
    assert moved > 1e-3 and worst < 1e-5, (moved, worst)


@pytest.mark.slow
def test_sigterm_saves_at_a_step_boundary_and_resume_continues_the_data(model_dir, straight, tmp_path):
    out = str(tmp_path / "term")
    proc = _launch(_args(model_dir, out, "trainer.steps=400", "checkpoint.save_every=0"))
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 2):
        time.sleep(0.2)
    # SIGTERM every rank, as SLURM does at preemption / time limit (torchrun itself exits 1 on a signal).
    for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(pid), signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-3000:]
    assert "preempted (SIGTERM)" in log
    done = _metrics(out)
    ckpt = open(os.path.join(out, "checkpoints", "latest")).read().strip()
    assert ckpt == f"step_{done[-1]['step']:06d}"  # the checkpoint is the last finished step
    _train(_args(model_dir, out, f"trainer.steps={done[-1]['step'] + 2}"))
    records = _strip(_metrics(out))
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # no step repeated or skipped
    full = _strip(_metrics(straight))
    for r in records[: len(full)]:  # same data order (and everything else) as the uninterrupted run
        assert r == full[r["step"] - 1]


@pytest.mark.slow
def test_corrupt_checkpoint_is_named_and_auto_falls_back(straight, tmp_path):
    import shutil

    from remax_megatron.checkpoint import CheckpointError, find_resume_checkpoint, validate

    root = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(straight, "checkpoints"), root)
    newest = os.path.join(root, "step_000006")
    shard = next(
        os.path.join(newest, "model", f) for f in os.listdir(os.path.join(newest, "model")) if f.endswith(".distcp")
    )
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=os.path.basename(shard) + " has"):
        validate(newest)
    with pytest.warns(UserWarning, match="skipping invalid checkpoint"):
        assert find_resume_checkpoint(root, "auto") == os.path.join(root, "step_000003")
    os.remove(os.path.join(root, "step_000003", "manifest.json"))
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        find_resume_checkpoint(root, os.path.join(root, "step_000003"))


@pytest.mark.slow
def test_a_checkpoint_of_a_newer_megatron_core_is_refused_before_any_model_is_built(model_dir, straight, tmp_path):
    """Every save records the versions that wrote it; one stamped with a newer megatron-core than the installed
    one is refused at resume in one line naming both (exit 2), and nothing of the run is started."""
    import shutil
    import zlib
    from importlib import metadata

    from remax_megatron.weights.provenance import META, installed_versions

    ckpt = str(tmp_path / "step_000006")
    shutil.copytree(os.path.join(straight, "checkpoints", "step_000006"), ckpt)
    with open(os.path.join(ckpt, META)) as f:
        meta = json.load(f)
    assert meta["versions"] == installed_versions()
    meta["versions"]["megatron_core"] = "99.0.0"
    data = json.dumps(meta).encode()
    with open(os.path.join(ckpt, META), "wb") as f:
        f.write(data)
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["files"][META] = {"size": len(data), "crc32": zlib.crc32(data)}  # a valid checkpoint otherwise
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    out = str(tmp_path / "run")
    r = run_main(
        "remax_megatron.train",
        _args(model_dir, out, "trainer.steps=8", f"checkpoint.resume={ckpt}")[2:],
        2,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert r.stderr.splitlines() == [
        f"error: checkpoint {ckpt} was written by megatron-core 99.0.0 and the installed megatron-core "
        f"{metadata.version('megatron-core')} cannot read a newer one's checkpoints: install megatron-core>=99.0.0 (it "
        "needs Python >= 3.12 from 0.17 on), or use a checkpoint written by this version"
    ], r.stderr[-3000:]
    assert "resumed from" not in r.stdout and not os.path.exists(os.path.join(out, "metrics.jsonl")), r.stdout


@pytest.mark.slow
def test_sigkill_of_one_rank_fails_the_job_quickly(model_dir, tmp_path):
    out = str(tmp_path / "kill")
    proc = _launch(_args(model_dir, out, "trainer.steps=400", "trainer.dist_timeout_minutes=1"))
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and not os.path.exists(metrics):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGKILL)
    proc.communicate(timeout=150)  # a hang (the survivor waiting on its peer for ever) fails here
    assert proc.returncode != 0


@pytest.mark.slow
def test_training_checkpoint_exports_to_hf(model_dir, straight, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = os.path.join(straight, "checkpoints", "step_000006")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    one, two = str(tmp_path / "hf1"), str(tmp_path / "hf2")
    r = subprocess.run(
        [sys.executable, "tools/convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", one],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [TORCHRUN, "--nproc_per_node=2", "tools/convert_megatron_to_hf.py", "--ckpt", ckpt, "--out", two, "--tp", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(f"{one}/model.safetensors"), load_file(f"{two}/model.safetensors")
    initial = load_file(f"{model_dir}/model.safetensors")
    assert sorted(a) == sorted(initial) and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # the trained weights, not the initial ones
    AutoModelForCausalLM.from_pretrained(one)


def _main_weights_body(rank, world, model_dir, root):
    import torch

    from remax_megatron.checkpoint import load_checkpoint, save_checkpoint
    from remax_megatron.config import load_config
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.optimizer import build_optimizer, wrap_ddp
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=world, pp=1, world_size=world).initialize(seed=0)
    cfg = load_config(None, ["reward.functions=[exact_match]", "optim.lr=1e-3"])

    def build():
        actor = build_policy(read_hf_config(model_dir), tp=world, pp=1, params_dtype=torch.bfloat16, init_weights=False)
        load_hf_weights(actor, model_dir)
        ddp = wrap_ddp(actor, False)
        return actor, build_optimizer(ddp, cfg.optim, torch.bfloat16)

    actor, opt = build()
    for p in opt.params:
        p.main_grad.copy_(torch.full_like(p.main_grad, 1e-3))
    assert opt.step()[0]
    masters = [m.clone() for m in opt.main_params]
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, p.float()) for m, p in zip(masters, opt.params))  # more than bf16 holds
    path = save_checkpoint(root, 1, actor, opt, {"step": 1, "world_size": world}, model_dir, keep=2)

    actor2, opt2 = build()
    load_checkpoint(path, actor2, opt2)
    for m, m2, p, p2 in zip(masters, opt2.main_params, opt.params, opt2.params):
        assert torch.equal(m, m2) and torch.equal(p, p2)


@pytest.mark.slow
def test_checkpoint_keeps_fp32_main_weights_of_bf16_params(model_dir, tmp_path):
    from tests._dist import run_distributed

    run_distributed(_main_weights_body, world_size=2, args=(model_dir, str(tmp_path / "ckpt")))


@pytest.mark.slow
def test_dynamic_sampling_resumes_drawing_exactly_what_the_straight_run_drew(model_dir, tmp_path):
    """algo.dynamic_sampling at dp2 with a reward under which every prompt with an odd answer ties: the
    steps draw more prompts than they train (rounds > 1 at some step), each step still trains
    prompts_per_step prompts, and a run stopped at step 2 and resumed draws and trains exactly what the
    straight run did (every metric of steps 1-4 bitwise, the data position included)."""
    common = (
        "actor.tp=1",
        "algo.dynamic_sampling=true",
        "reward.functions=[tests.rollout.tie_rewards:ties_on_odd_answers]",
        "checkpoint.save_every=2",
    )
    straight, out = str(tmp_path / "straight"), str(tmp_path / "run")
    _train(_args(model_dir, straight, "trainer.steps=4", *common))
    _train(_args(model_dir, out, "trainer.steps=2", *common))
    _train(_args(model_dir, out, "trainer.steps=4", "checkpoint.resume=auto", *common))
    full, resumed = _strip(_metrics(straight)), _strip(_metrics(out))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed == full
    assert max(r["sampling/rounds"] for r in full) > 1 and sum(r["sampling/dropped_prompts"] for r in full) > 0
    for r in full:
        assert r["sampling/prompts_drawn"] == 4 * r["sampling/rounds"] and r["batch/real_tokens"] > 0
        assert r["batch/computed_rows"] + r["batch/skipped_rows"] == 4 * 2  # prompts_per_step x rollout.n rows
        assert r["data/position"] >= r["sampling/prompts_drawn"] or r["data/epoch"] > 0
