"""launch/torchrun.sh and launch/slurm/remax.sbatch: dry runs, node lists, the srun path, requeue, bad input.

The SLURM script runs here under plain bash with the SLURM_* variables of a
2-node job. scontrol and srun are absent on this machine (the bash node-list
fallback is tested); fake ones on PATH stand in for the real-run path.
"""

import atexit
import functools
import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(REPO, "launch", "slurm", "remax.sbatch")
TORCHRUN_SH = os.path.join(REPO, "launch", "torchrun.sh")
EXAMPLE = os.path.join(REPO, "launch", "slurm", "example_2x8.sh")
SLURM_KEYS = (
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES",
    "SLURM_JOB_ID",
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS_PER_NODE",
    "SLURM_SUBMIT_DIR",
    "SLURM_RESTART_COUNT",
    "SLURM_CPUS_ON_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GPUS_PER_NODE",
    "NNODES",
    "NPROC",
    "DRY_RUN",
    "CUDA_VISIBLE_DEVICES",
    "PYTHON",
    "TORCHRUN",
)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("reward:\n  functions: [exact_match]\n")
    return str(path)


# The machine a test describes has exactly the cluster tools its fakes provide: a SLURM login node or
# a GPU box that runs the suite must not leak its own scontrol / srun / nvidia-smi into a test.
CLUSTER_TOOLS = ("scontrol", "srun", "sbatch", "squeue", "scancel", "nvidia-smi")


@functools.cache
def _path_without_cluster_tools() -> str:
    """$PATH with every directory that holds a cluster tool replaced by a directory of links to its other
    programs."""
    dirs = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and any(os.path.exists(os.path.join(d, tool)) for tool in CLUSTER_TOOLS):
            shadow = tempfile.mkdtemp(prefix="remax-path-")
            atexit.register(shutil.rmtree, shadow, True)
            for name in os.listdir(d):
                if name not in CLUSTER_TOOLS:
                    os.symlink(os.path.join(d, name), os.path.join(shadow, name))
            d = shadow
        dirs.append(d)
    return os.pathsep.join(dirs)


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SLURM_KEYS}
    env["PATH"] = _path_without_cluster_tools()
    return env


def _run(script, args, path_dirs=(), **env):
    base = _clean_env()
    base["PATH"] = os.pathsep.join([*path_dirs, base["PATH"]])  # the test's fakes first
    base.update(env)
    return subprocess.run(["bash", script, *args], cwd=REPO, env=base, capture_output=True, text=True, timeout=60)


def _commands(stdout):
    """{node line: argv} of a dry run: '# node i: host' comment, then the command line."""
    lines = stdout.splitlines()
    return {lines[i][2:]: shlex.split(lines[i + 1]) for i, line in enumerate(lines) if line.startswith("# node ")}


def _fake(dirpath, name, body):
    path = os.path.join(dirpath, name)
    with open(path, "w") as f:
        f.write("#!/usr/bin/env bash\nset -euo pipefail\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def _no_slurm_tools():
    r = subprocess.run(["bash", "-c", "command -v scontrol || command -v srun"], env=_clean_env(), capture_output=True)
    return r.returncode != 0


def test_sbatch_dry_run_prints_both_nodes(config):
    assert _no_slurm_tools(), "this test checks the bash node-list fallback"
    r = _run(
        SBATCH,
        [config, "actor.tp=2", "trainer.steps=3"],
        DRY_RUN="1",
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_ON_NODE="8",
    )
    assert r.returncode == 0, r.stderr
    cmds = _commands(r.stdout)
    assert list(cmds) == ["node 0: node01", "node 1: node02"]
    for rank, argv in enumerate(cmds.values()):
        assert argv[:3] == ["python", "-m", "remax_megatron.launch"]
        for flag in (
            "--nnodes=2",
            "--nproc_per_node=8",
            f"--node_rank={rank}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=node01:29500",
            "--rdzv_id=4242",
        ):
            assert flag in argv, (flag, argv)
        tail = argv[argv.index("remax_megatron.train") - 1 :]
        assert tail == [
            "-m",
            "remax_megatron.train",
            "--config",
            config,
            "actor.tp=2",
            "trainer.steps=3",
            "checkpoint.resume=auto",
        ]
    assert "NCCL_DEBUG=WARN" in r.stdout


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("alpha,beta", ["alpha", "beta"]),
        ("gpu[1-2,5],cpu7", ["gpu1", "gpu2", "gpu5", "cpu7"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-ib[3-4]", ["r1-ib3", "r1-ib4", "r2-ib3", "r2-ib4"]),
    ],
)
def test_nodelist_expansion_without_scontrol(config, nodelist, hosts):
    r = _run(SBATCH, [config], DRY_RUN="1", SLURM_JOB_NODELIST=nodelist, GPUS_PER_NODE="4", MASTER_PORT="31000")
    assert r.returncode == 0, r.stderr
    cmds = _commands(r.stdout)
    assert [k.split(": ")[1] for k in cmds] == hosts
    assert all(
        f"--rdzv_endpoint={hosts[0]}:31000" in argv and f"--nnodes={len(hosts)}" in argv for argv in cmds.values()
    )


def test_scontrol_is_used_when_present(config, tmp_path):
    _fake(str(tmp_path), "scontrol", 'if [[ "$1 $2" == "show hostnames" ]]; then printf "x1\\nx2\\n"; fi\n')
    r = _run(
        SBATCH,
        [config],
        path_dirs=[str(tmp_path)],
        DRY_RUN="1",
        SLURM_JOB_NODELIST="whatever[9]",
        SLURM_NNODES="2",
        GPUS_PER_NODE="2",
    )
    assert r.returncode == 0, r.stderr
    assert list(_commands(r.stdout)) == ["node 0: x1", "node 1: x2"]


def test_explicit_resume_kept_on_first_run_and_auto_on_requeue(config):
    env = dict(DRY_RUN="1", SLURM_JOB_NODELIST="a", GPUS_PER_NODE="1")
    first = _run(SBATCH, [config, "checkpoint.resume=none"], **env)
    again = _run(SBATCH, [config, "checkpoint.resume=none"], SLURM_RESTART_COUNT="1", **env)
    assert list(_commands(first.stdout).values())[0][-1] == "checkpoint.resume=none"
    assert list(_commands(again.stdout).values())[0][-1] == "checkpoint.resume=auto"


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(GPUS_PER_NODE="8"), "no rendezvous address: SLURM_JOB_NODELIST is unset and MASTER_ADDR is empty"),
        (dict(SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES="3", GPUS_PER_NODE="8"), "SLURM_NNODES=3 but"),
        (dict(SLURM_JOB_NODELIST="n[1-2]"), "GPUs per node unknown"),
        (dict(SLURM_JOB_NODELIST="n[a-b]", GPUS_PER_NODE="8"), "cannot expand node list item"),
    ],
)
def test_sbatch_bad_input_is_one_line(config, env, message):
    r = _run(SBATCH, [config], DRY_RUN="1", **env)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_sbatch_master_addr_without_nodelist(config):
    r = _run(SBATCH, [config], DRY_RUN="1", MASTER_ADDR="10.0.0.5", NNODES="2", GPUS_PER_NODE="8")
    assert r.returncode == 0, r.stderr
    cmds = list(_commands(r.stdout).values())
    assert len(cmds) == 2 and all("--rdzv_endpoint=10.0.0.5:29500" in c for c in cmds)


def test_sbatch_outside_slurm_refuses_real_run(config):
    r = _run(SBATCH, [config], SLURM_JOB_NODELIST="a", GPUS_PER_NODE="1")
    assert r.returncode == 2 and "not inside a SLURM allocation" in r.stderr


def _fake_cluster(tmp_path, srun_sleep=0):
    """srun that runs the task once per node with SLURM_NODEID set (and logs a USR1 it receives, as the
    real srun forwards it to the tasks); python (the launcher's interpreter) that logs its argv."""
    d = str(tmp_path / "bin")
    os.makedirs(d)
    log = tmp_path / "calls.log"
    _fake(
        d,
        "srun",
        f'echo "srun $*" >> {log}\n'
        "while [[ $1 == --* ]]; do shift; done\n"
        f"trap 'echo \"srun got USR1\" >> {log}; exit 0' USR1\n"
        f"sleep {srun_sleep} & wait $!\n"
        'for ((i = 0; i < 2; i++)); do SLURM_NODEID=$i "$@"; done\n',
    )
    _fake(d, "python", f'echo "python $*" >> {log}\n')
    _fake(
        d,
        "scontrol",
        f'if [[ "$1 $2" == "show hostnames" ]]; then printf "h1\\nh2\\n"; exit 0; fi\necho "scontrol $*" >> {log}\n',
    )
    return d, log


def test_sbatch_real_path_runs_one_torchrun_per_node(config, tmp_path):
    bindir, log = _fake_cluster(tmp_path)
    r = _run(
        SBATCH,
        [config, "actor.tp=2"],
        path_dirs=[bindir],
        SLURM_JOB_NODELIST="h[1-2]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="7",
        GPUS_PER_NODE="8",
        SLURM_CPUS_ON_NODE="64",
        LOG_DIR=str(tmp_path / "logs"),
    )
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1")
    assert "--cpus-per-task=64" in calls[0] and f"--output={tmp_path}/logs/%j-node%n-%N.log" in calls[0]
    dry = _run(
        SBATCH,
        [config, "actor.tp=2"],
        path_dirs=[bindir],
        DRY_RUN="1",
        SLURM_JOB_NODELIST="h[1-2]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="7",
        GPUS_PER_NODE="8",
    )
    # what srun ran on each node is exactly what the dry run printed
    assert [shlex.split(c) for c in calls[1:]] == list(_commands(dry.stdout).values())
    assert (tmp_path / "logs").is_dir()


def test_usr1_requeues_the_job(config, tmp_path):
    bindir, log = _fake_cluster(tmp_path, srun_sleep=5)
    env = _clean_env()
    env.update(
        PATH=bindir + os.pathsep + env["PATH"],
        SLURM_JOB_NODELIST="h[1-2]",
        SLURM_JOB_ID="99",
        GPUS_PER_NODE="8",
        LOG_DIR=str(tmp_path / "logs"),
    )
    p = subprocess.Popen(
        ["bash", SBATCH, config], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 30
    while not (log.exists() and "srun" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err  # kept waiting for srun after the trap
    calls = log.read_text().splitlines()
    # the workers are stopped first (they save), the job is requeued once they have exited
    assert calls.index("srun got USR1") < calls.index("scontrol requeue 99"), calls
    assert "requeueing job 99" in err


def test_torchrun_sh_dry_run_and_gpu_count(config):
    r = _run(TORCHRUN_SH, [config, "actor.tp=2"], DRY_RUN="1", NPROC="3")
    assert shlex.split(r.stdout) == [
        "python",
        "-m",
        "remax_megatron.launch",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node=3",
        "-m",
        "remax_megatron.train",
        "--config",
        config,
        "actor.tp=2",
    ]
    r = _run(TORCHRUN_SH, [config], DRY_RUN="1", CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert "--nproc_per_node=4" in shlex.split(r.stdout)
    r = _run(TORCHRUN_SH, [config], DRY_RUN="1", CUDA_VISIBLE_DEVICES="")
    assert "--nproc_per_node=1" in shlex.split(r.stdout) and "no GPU visible" in r.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "no config file given"),
        (["missing.yaml"], {}, "config file missing.yaml not found"),
        (["CONFIG", "actor.tp"], {}, "override 'actor.tp' is not key=value"),
        (["CONFIG"], {"NPROC": "two"}, "NPROC=two is not a positive integer"),
    ],
)
def test_torchrun_sh_bad_input_is_one_line(config, args, env, message):
    r = _run(TORCHRUN_SH, [config if a == "CONFIG" else a for a in args], DRY_RUN="1", **env)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1


def test_example_2x8_dry_run(config):
    r = _run(EXAMPLE, [config], DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    cmds = list(_commands(r.stdout).values())
    assert len(cmds) == 2
    assert all("--nnodes=2" in c and "--nproc_per_node=8" in c and "actor.tp=4" in c for c in cmds)
