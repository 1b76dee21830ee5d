"""Multi-node on one machine: two torchrun launchers (--nnodes=2, c10d rendezvous on
127.0.0.1) must train exactly like one launcher with two processes.

This is what remax.sbatch does on a cluster (one torchrun per node, c10d on the
first node), with loopback instead of the network. Metrics must match except
wall-clock ones (time/*, throughput/*, memory/*, perf/*), which differ between any two runs.
"""

import json
import math
import os
import socket
import subprocess
import sys

import pytest

from tests._dist import run_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_DEPENDENT = ("time/", "throughput/", "memory/", "perf/")
TIMEOUT_S = 900
CONFIG = "configs/tiny_cpu.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(out_dir: str) -> list[str]:
    return [
        "trainer.steps=2",
        "trainer.eval_every=0",
        f"trainer.output_dir={out_dir}",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "checkpoint.resume=none",
        "checkpoint.save_every=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
    ]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    return env


def _torchrun(launcher_args: list[str], out_dir: str, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        "--max_restarts=0",
        "-m",
        "remax_megatron.train",
        "--config",
        CONFIG,
        *_overrides(out_dir),
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def _wait(procs, logs):
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            with open(log.name) as f:
                tail = f.read()[-4000:]
            pytest.fail(f"{' '.join(map(str, p.args))} exited {p.returncode}:\n{tail}")


def _metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(RUN_DEPENDENT)} for r in records]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@pytest.mark.slow
def test_two_launchers_equal_one_launcher_with_two_processes(tmp_path):
    port = _free_port()
    multi, single = str(tmp_path / "two_nodes"), str(tmp_path / "one_node")
    logs = [open(tmp_path / f"node{rank}.log", "w") for rank in range(2)]
    nodes = [
        _torchrun(
            [
                "--nnodes=2",
                "--nproc_per_node=1",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=remax-loopback",
                f"--node_rank={rank}",
            ],
            multi,
            logs[rank],
        )
        for rank in range(2)
    ]
    _wait(nodes, logs)
    for f in logs:
        f.close()
    # One launcher's two workers, forked from the tests' warm fork server (what torchrun starts)
    one = run_main("remax_megatron.train", ["--config", CONFIG, *_overrides(single)], 2, env=_env())
    assert one.returncode == 0, (one.stdout + one.stderr)[-4000:]

    got, want = _metrics(multi), _metrics(single)
    assert [r.get("step") for r in got] == [r.get("step") for r in want] and len(got) >= 2
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), sorted(set(g) ^ set(w))
        diff = {k: (g[k], w[k]) for k in g if not _same(g[k], w[k])}
        assert not diff, f"step {g.get('step')}: {diff}"
