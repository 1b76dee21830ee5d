"""Run a test body on several gloo processes (CPU; NCCL, one GPU per rank, with CUDA), the way
torchrun would.

Usage inside a test:

    def _body(rank, world_size, tmp):     # runs in every process
        ...assert...

    def test_x(tmp_path):
        run_distributed(_body, world_size=2, args=(str(tmp_path),))

The body must be a module-level function (it is pickled). A failing assert in any rank fails the
test with that rank's traceback. CPU ranks are forked from a fork server that imported torch,
megatron-core and transformers once (PRELOAD), and get the launching test's environment and working
directory, as spawned processes would. CUDA ranks (`device="cuda"`, or CUDA available and no device
asked for) are spawned: a process forked from one that has called `torch.cuda.is_available()` cannot
initialise CUDA ("Cannot re-initialize CUDA in forked subprocess"), and PRELOAD does call it (megatron-core
0.16.1's dist_checkpointing/strategies/torch.py, at import, through remax_megatron.weights; vLLM's Triton
driver check, where vLLM is installed). See `start_method`.

run_distributed_cases runs several such bodies (cases) in one launch, one process start per rank
instead of one per case, and says which case failed.
"""

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cuda_workers(device: str | None = None) -> bool:
    """Whether the ranks run on CUDA (one GPU per rank, NCCL): as the test asks (`device` "cuda" or "cpu"),
    else when this process sees CUDA."""
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device={device!r}: use 'cuda', 'cpu' or None (CUDA when available)")
    return torch.cuda.is_available() if device is None else device == "cuda"


def start_method(cuda: bool) -> str:
    """How ranks start. CPU: forked from the warm fork server (imports once per test process). CUDA: spawned,
    each rank a fresh interpreter, since torch refuses CUDA in a process forked from one whose imports
    asked the CUDA runtime anything (`torch.cuda.is_available()` calls cudaGetDeviceCount, which poisons
    fork unless PYTORCH_NVML_BASED_CUDA_CHECK=1), and which library does so at import is not ours to
    keep true. A spawned rank pays its imports (a few seconds); the GPU tests launch a handful."""
    return "spawn" if cuda else "forkserver"


def _worker(rank, world_size, port, fn, args, errors, environ=None, cwd=None, cuda=False):
    if environ is not None:  # the launching test's environment and directory, as a spawned process inherits them
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch.distributed as dist

    torch.set_num_threads(1)
    if cuda:  # tests/gpu: one GPU per rank, NCCL as under torchrun
        if rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank} of {world_size} needs {world_size} GPUs; {torch.cuda.device_count()} here")
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        import sys

        if "vllm" in sys.modules:  # vLLM's groups (and, external launcher, the default group) go first
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        if dist.is_initialized():
            dist.destroy_process_group()


# What every CPU rank imports: the fork server imports it once, and each rank is forked from there with it
# already imported (a spawned rank spent ~6 s of CPU importing torch, megatron-core and transformers; a
# 4-process launch on 2 cores waited ~24 s before its first line).
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "remax_megatron.models.gpt",
    "remax_megatron.trainer",
    "remax_megatron.weights",
    "tests._dist",
    "vllm",
    "vllm.entrypoints.llm",
]


def _context(cuda: bool | None = None):
    """The multiprocessing context of a launch: `start_method(cuda)`, with PRELOAD for the fork server.
    `cuda` None: as `cuda_workers()` says."""
    method = start_method(cuda_workers() if cuda is None else cuda)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, args: tuple = (), device: str | None = None) -> None:
    """`fn(rank, world_size, *args)` on `world_size` ranks; `device`: see `cuda_workers`."""
    cuda = cuda_workers(device)
    ctx = _context(cuda)
    errors = ctx.SimpleQueue()
    port = _free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors, env, cwd, cuda))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    assert not bad, f"processes exited non-zero: {bad}"


def _cases_worker(rank, world_size, cases, done_path):
    """Run the cases in order; after each, note it as done on this rank. The first failure stops this
    launch (another rank may wait in a collective of that case) and names the case."""
    for name, (fn, args) in cases.items():
        try:
            fn(rank, world_size, *args)
        except BaseException as e:
            raise RuntimeError(f"case {name!r} failed on rank {rank}") from e
        with open(f"{done_path}.rank{rank}", "a") as f:
            f.write(name + "\n")


def run_distributed_cases(cases: dict, world_size: int, done_dir: str) -> dict:
    """Several bodies in ONE launch of `world_size` processes (one process start, one import of torch
    and megatron per rank, instead of one per case): `cases` is {name: (fn, args)} with `fn` as in
    run_distributed. Returns {name: None if it completed on every rank, else its failure}. A failed
    case stops its launch; the cases after it then run in a new launch, so every case still runs and
    each failure is reported under its own name."""
    os.makedirs(done_dir, exist_ok=True)
    outcome, todo, attempt = {}, list(cases), 0
    while todo:
        done_path = os.path.join(done_dir, f"launch{attempt}")
        try:
            run_distributed(_cases_worker, world_size, args=({n: cases[n] for n in todo}, done_path))
            failure = None
        except AssertionError as e:
            failure = str(e)
        done = []
        for rank in range(world_size):
            path = f"{done_path}.rank{rank}"
            done.append(set(open(path).read().split("\n")) if os.path.exists(path) else set())
        for name in list(todo):
            if not all(name in d for d in done):
                break
            outcome[name] = None
            todo.remove(name)
        if todo:  # the first case not done everywhere is the one that stopped the launch
            assert failure is not None, f"launch ended without error but {todo[0]!r} is not done on every rank"
            outcome[todo.pop(0)] = f"case failed in its shared launch of {world_size} processes:\n{failure}"
        attempt += 1
    return outcome


class SharedLaunches:
    """Cases of several tests, {world_size: {name: (fn, args)}}, run in one launch per world size: the
    first test that asks for a case of a world size starts that launch (a module-scoped fixture holds
    this object). `check(name)` fails with the case's own traceback, or names the case that stopped
    the launch before it."""

    def __init__(self, cases_by_world: dict, done_dir: str):
        self.cases, self.done_dir, self.outcome = cases_by_world, done_dir, {}

    def check(self, name: str) -> None:
        world = next(w for w, cases in self.cases.items() if name in cases)
        if world not in self.outcome:
            self.outcome[world] = run_distributed_cases(
                self.cases[world], world, os.path.join(self.done_dir, f"world{world}")
            )
        assert self.outcome[world][name] is None, self.outcome[world][name]


class Completed:
    """What a launch of `main` left: its exit code and every rank's stdout and stderr, rank by rank (as
    torchrun's own output holds its workers')."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _main_worker(rank, world_size, port, module, argv, out_dir, environ, cwd):
    """A torchrun worker without torchrun: the environment torchrun gives its workers, stdout and stderr
    into files, `module.main(argv)` (which initialises the process group from that environment), and the
    exit code the command would have."""
    import importlib
    import sys

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for fd, name in ((1, "out"), (2, "err")):
        with open(os.path.join(out_dir, f"rank{rank}.{name}"), "w") as f:
            os.dup2(f.fileno(), fd)
    code = 0
    try:
        importlib.import_module(module).main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback goes where the command's would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the command's process ends: no fork-server bookkeeping after main


def run_main(module: str, argv: list[str], nproc: int, env: dict | None = None, timeout: float = 900) -> Completed:
    """`torchrun --nproc_per_node=nproc -m module *argv` with ranks forked from the warm fork server
    (torch, megatron-core, transformers and vLLM imported once per test process instead of once per
    rank and launch; spawned where CUDA is available, see `start_method`). `env`: the ranks' environment
    (default: this process's), as subprocess takes it. For what the ranks compute; what torchrun itself
    does (its exit codes, signals, its error report) is tested with the real command."""
    import tempfile

    ctx = _context()
    out_dir = tempfile.mkdtemp(prefix="remax-main-")
    port = _free_port()
    environ = dict(os.environ if env is None else env)
    procs = [
        ctx.Process(target=_main_worker, args=(r, nproc, port, module, argv, out_dir, environ, os.getcwd()))
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]

    def read(name):
        return "".join(
            open(os.path.join(out_dir, f"rank{r}.{name}")).read()
            for r in range(nproc)
            if os.path.exists(os.path.join(out_dir, f"rank{r}.{name}"))
        )

    return Completed(max(codes, key=lambda c: c != 0), read("out"), read("err"))
