"""Training checkpoints: atomic, validated, resumable at another TP/PP layout.

    <checkpoint.dir>/
      step_000006/
        model/             megatron dist_checkpointing of the actor (layout-free)
        optimizer/         dist_checkpointing of the Adam state, sharded like the params
        hf_config/         config.json + tokenizer of the actor (tools/convert_megatron_to_hf.py)
        rng/rank_<r>.pt    every rank's RNG states
        trainer_state.json step, data-loader position, LR scheduler, KL controller, counters
        remax_checkpoint.json
        manifest.json      every file, its size and CRC-32, written last: a checkpoint without it is
                           incomplete; resume verifies it (the ranks split the reading)
      latest               name of the newest complete checkpoint (updated after the rename)

A save writes into `.tmp-step_*` and renames it into place only when every rank
finished; a failure anywhere (disk full, unwritable) removes the temporary
directory and leaves the previous checkpoints untouched.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import tempfile
import warnings
import zlib

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from remax_megatron.parallel.layout import all_reduce_cpu
from remax_megatron.weights.megatron_ckpt import load_model, save_model, save_sharded

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MANIFEST, LATEST, TRAINER_STATE = "manifest.json", "latest", "trainer_state.json"
TMP_PREFIX = ".tmp-"  # a save in progress: .tmp-step_000006-<random>


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---- saving ------------------------------------------------------------------------------------


def save_checkpoint(root: str, step: int, model, optimizer, trainer_state: dict, hf_dir: str, keep: int) -> str:
    """Collective: write checkpoint `step` under `root`; returns its path.

    Any failure (disk full inside dist_checkpointing included) raises CheckpointError with one
    line on every rank, after the `.tmp-step_*` directory is removed; earlier checkpoints stay.
    """
    rank = dist.get_rank()
    final = os.path.join(root, step_dir_name(step))
    tmp, error = [None], None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            tmp[0] = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step_dir_name(step)}-", dir=root)
        except OSError as e:
            error = e
    dist.broadcast_object_list(tmp, src=0)
    _agree(error, f"cannot create a checkpoint directory in {root}")
    try:
        _write(tmp[0], final, root, step, model, optimizer, trainer_state, hf_dir)
    except CheckpointError:
        _discard(tmp[0], collective=True)  # every rank got here through _agree
        raise
    except BaseException:
        _discard(tmp[0], collective=False)  # a collective broke (peer died) or an interrupt
        raise
    if rank == 0:
        _prune(root, keep)
    dist.barrier()
    return final


def preemption_save_refusal(
    signal_name: str, save_seconds: float, environ=None, parent_pid: int | None = None
) -> str | None:
    """Why a save on a stop signal would be killed half-way, or None when it may start.

    Plain torchrun forwards SIGTERM to its workers and SIGKILLs them `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`
    (default 30) seconds later: a save expected to take longer (`save_seconds`, the last save's
    duration agreed over the ranks; 0 when unknown) is refused up front, with the numbers, and the
    previous checkpoint stays the newest. No grace runs under remax_megatron.launch (REMAX_LAUNCHER),
    on SIGUSR1 (torchrun does not handle it), or once the launcher is gone (`parent_pid`, default
    REMAX_LAUNCHER_PID noted by train.main at start-up, is no longer this process's parent).
    """
    env = os.environ if environ is None else environ
    if signal_name != "SIGTERM" or "TORCHELASTIC_RUN_ID" not in env or env.get("REMAX_LAUNCHER") == "1":
        return None
    if parent_pid is None and env.get("REMAX_LAUNCHER_PID", "").isdigit():  # noted by train.main
        parent_pid = int(env["REMAX_LAUNCHER_PID"])
    if parent_pid is not None and os.getppid() != parent_pid:
        return None
    grace = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    if save_seconds <= grace * 0.8:  # a margin for the step's end and the rename
        return None
    return (
        f"not saving: the last save took {save_seconds:.0f} s and plain torchrun kills its workers "
        f"{grace:.0f} s after forwarding SIGTERM (TORCH_ELASTIC_SHUTDOWN_TIMEOUT / --shutdown-timeout); "
        "launch with python -m remax_megatron.launch (it waits for the save) or raise that timeout"
    )


def _write(tmp: str, final: str, root: str, step: int, model, optimizer, trainer_state: dict, hf_dir: str) -> None:
    """The collective body of save_checkpoint: preflight, shards, checksums, manifest, rename."""
    rank, error = dist.get_rank(), None
    # Every rank checks it can write and that the disk holds the whole checkpoint before any
    # collective write starts: a rank that failed inside dist_checkpointing.save would leave the
    # others waiting in its collectives.
    weights, optim = _checkpoint_bytes(model)
    try:
        _preflight(tmp, weights, optim, _previous_size(root))
    except OSError as e:
        error = e
    _agree(error, f"cannot save checkpoint {final}")
    try:
        save_model(model, tmp, hf_dir)
        optim_dir = os.path.join(tmp, "optimizer")
        if rank == 0:
            os.makedirs(optim_dir, exist_ok=True)
        dist.barrier()
        save_sharded(optimizer.sharded_state_dict(model.sharded_state_dict()), optim_dir)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            _write_json(
                os.path.join(tmp, TRAINER_STATE), {**trainer_state, "step": step, "world_size": dist.get_world_size()}
            )
    # torch's CheckpointException (a failed write inside dist_checkpointing) is a BaseException.
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn about any rank's failure
        error = e
    _agree(error, f"saving checkpoint {final} failed")
    dist.barrier()
    # Checksums: every rank reads its share of the files (just written, so from the page cache).
    files = None
    try:
        files = _describe_files(tmp, _share(_walk(tmp)))
    except OSError as e:
        error = e
    _agree(error, f"checksumming checkpoint {final} failed")
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, files)
    if rank == 0:
        try:
            _write_json(
                os.path.join(tmp, MANIFEST),
                {"checksum": "crc32", "files": dict(sorted(kv for d in shares for kv in d.items()))},
            )
            if os.path.exists(final):  # a re-save of the same step (e.g. after a fallback)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_text_atomic(os.path.join(root, LATEST), step_dir_name(step))
        except OSError as e:
            error = e
    _agree(error, f"finishing checkpoint {final} failed")


def _discard(tmp: str | None, collective: bool) -> None:
    """Remove a failed save's temporary directory (rank 0; with `collective`, then every rank
    that still sees it, e.g. on a node-local disk)."""
    if tmp is None:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if collective:
        dist.barrier()
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_bytes(model) -> tuple[int, int]:
    """Collective: bytes of the whole checkpoint (weights, optimizer state), the same on every rank.

    Each rank counts its own parameters: the weights, two fp32 Adam moments and an fp32 main copy
    of a low-precision parameter. Data-parallel replicas write the same shards once, hence / dp.
    """
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    optim = sum(p.numel() * (8 + (4 if p.element_size() < 4 else 0)) for p in params if p.requires_grad)
    cfg = model.config
    dp = max(1, dist.get_world_size() // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size))
    total = all_reduce_cpu(torch.tensor([weights, optim], dtype=torch.float64)) / dp
    return int(total[0].item()), int(total[1].item())


def _previous_size(root: str) -> int:
    """Bytes of the newest checkpoint under root by its manifest (0 when there is none)."""
    for name in reversed(list_checkpoints(root)):
        try:
            return sum(_entry(v)[0] for v in _read_manifest(os.path.join(root, name)).values())
        except CheckpointError:
            continue
    return 0


def _preflight(directory: str, weights: int, optim: int, previous: int) -> None:
    """Raise OSError when this rank cannot write into `directory` or the disk cannot hold the whole
    checkpoint (every rank writes to the same disk: the node needs the total, not one rank's share)."""
    probe = os.path.join(directory, f".probe-{dist.get_rank()}")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
        f.flush()
        os.fsync(f.fileno())
    os.remove(probe)
    need = max(weights + optim, previous) + (1 << 20)  # side files, metadata, RNG states
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device: the checkpoint needs about {_size(need)} "
            f"({_size(weights)} weights + {_size(optim)} optimizer state"
            f"{f', the previous one took {_size(previous)}' if previous else ''}), "
            f"{_size(free)} free in {os.path.dirname(directory)}: free space, "
            "lower checkpoint.keep or point checkpoint.dir at a bigger disk",
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _one_line(error: BaseException) -> str:
    """`Type: first line` of an error. torch's CheckpointException: `rank r: ...` of the first rank
    it names as failed, or "" when it names none (that rank tells its own)."""
    if isinstance(error, CheckpointException):
        failures = sorted(error.failures.items(), key=lambda kv: kv[0])
        if not failures:
            return ""
        rank, failure = failures[0]
        return f"rank {rank}: {_one_line(failure[0] if isinstance(failure, tuple) else failure)}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed (no rank is left waiting in a collective); every
    rank's message names the first rank with a reason and that reason, in one line."""
    flag = all_reduce_cpu(torch.tensor([0 if error is None else 1], dtype=torch.int32))
    if flag.item():
        reason = _one_line(error) if error is not None else ""
        if reason and not reason.startswith("rank "):
            reason = f"rank {dist.get_rank()}: {reason}"
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, reason)
        raise CheckpointError(f"{what}: " + next((r for r in reasons if r), "failed on another rank"))


def _write_json(path: str, data) -> None:
    _write_text_atomic(path, json.dumps(data, indent=2))


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _walk(top: str) -> list[str]:
    """Every file under `top`, relative to it, sorted (the same list on every rank)."""
    return sorted(os.path.relpath(os.path.join(d, n), top) for d, _, names in os.walk(top) for n in names)


def _share(items: list) -> list:
    """This rank's share of `items` (all of them outside torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return items[dist.get_rank() :: dist.get_world_size()]
    return items


def _describe_files(top: str, rels: list[str]) -> dict:
    return {
        rel: {"size": os.path.getsize(os.path.join(top, rel)), "crc32": _crc32(os.path.join(top, rel))} for rel in rels
    }


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def remove_stale_saves(root: str) -> list[str]:
    """Remove the `.tmp-step_*` directories of saves that never finished (a run killed mid-save);
    returns their paths. Only for the run that holds root's lock (run_lock.py): no live process
    writes into them then."""
    removed = []
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.startswith(TMP_PREFIX + "step_") and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _prune(root: str, keep: int) -> None:
    for name in list_checkpoints(root)[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- finding and validating --------------------------------------------------------------------


def latest_checkpoint(root: str) -> str | None:
    """The path `latest` names under root, or None."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            return os.path.join(root, f.read().strip())
    except OSError:
        return None


def list_checkpoints(root: str) -> list[str]:
    """Checkpoint directory names under root, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((n for n in os.listdir(root) if STEP_DIR.match(n)), key=lambda n: int(STEP_DIR.match(n)[1]))


def _read_manifest(path: str) -> dict:
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        raise CheckpointError(f"{manifest} is missing: checkpoint {path} is incomplete")
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
        for entry in files.values():
            _entry(entry)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest} is unreadable ({type(e).__name__}: {e})") from None
    return files


def _entry(entry) -> tuple[int, int | None]:
    """(size, crc32 or None) of a manifest entry (older manifests hold the size only)."""
    if isinstance(entry, int):
        return entry, None
    return int(entry["size"]), (None if entry.get("crc32") is None else int(entry["crc32"]))


def validate(path: str) -> None:
    """Raise CheckpointError naming the first missing, truncated or corrupted file of `path`.

    Sizes are checked on every rank; the checksums are split between the ranks; the verdict is
    shared, so under torch.distributed every rank must call this (the trainer's resume does), and
    every rank gets the same one even when a rank alone saw a problem (ranks that disagreed would
    resume different checkpoints, or wait in different collectives)."""
    try:
        problem = _problem(path)
    except CheckpointError as e:
        problem = str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
        problem = next((v for v in verdicts if v is not None), None)
    if problem:
        raise CheckpointError(problem)


def _problem(path: str) -> str | None:
    """This rank's finding on `path` (its share of the checksums), or None."""
    files = _read_manifest(path)
    for rel, entry in files.items():
        full, size = os.path.join(path, rel), _entry(entry)[0]
        if not os.path.isfile(full):
            return f"{full} is missing from checkpoint {path}"
        if os.path.getsize(full) != size:
            return (
                f"{full} has {os.path.getsize(full)} bytes, the manifest says {size}: the checkpoint is "
                "truncated or corrupted"
            )
    for rel in _share(sorted(files)):
        expected = _entry(files[rel])[1]
        if expected is None:
            continue
        got = _crc32(os.path.join(path, rel))
        if got != expected:
            return (
                f"{os.path.join(path, rel)} does not match its checksum in {MANIFEST} (crc32 {got:08x}, "
                f"expected {expected:08x}): the checkpoint is corrupted"
            )
    return None


def find_resume_checkpoint(root: str, resume: str) -> str | None:
    """resume=none -> None; a path -> that checkpoint (validated); auto -> the newest valid one under root.

    Under torch.distributed it is collective and every rank returns the same path: rank 0 lists the
    checkpoints and the ranks validate them together, newest first (ranks that listed for themselves
    could pick different ones while another process wrote there)."""
    if resume == "none":
        return None
    if resume != "auto":
        validate(resume)
        return resume
    names = [list_checkpoints(root)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)
    for name in reversed(names[0]):
        path = os.path.join(root, name)
        try:
            validate(path)
            return path
        except CheckpointError as e:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
                warnings.warn(f"skipping invalid checkpoint: {e}", stacklevel=2)
    return None


# ---- loading -----------------------------------------------------------------------------------


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Collective: load weights and optimizer state (any TP/PP layout); returns the trainer state."""
    try:
        load_model(model, path)
    except ValueError as e:  # a checkpoint of another model (shapes named)
        raise CheckpointError(str(e)) from None
    try:
        state = dist_checkpointing.load(
            optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True), os.path.join(path, "optimizer")
        )
        optimizer.load_sharded_state_dict(state)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the message says what was reset
        raise CheckpointError(
            f"optimizer state in {path}/optimizer could not be loaded ({_one_line(e)}); "
            "resume with checkpoint.resume=none to start fresh"
        ) from None
    with open(os.path.join(path, TRAINER_STATE)) as f:
        trainer_state = json.load(f)
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if trainer_state.get("world_size") == dist.get_world_size() and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
        "cuda_present": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda_present", False) != torch.cuda.is_available():
        # The tracker holds CUDA generator states on GPU and CPU ones on CPU (parallel/cpu_compat):
        # a checkpoint from the other kind of machine keeps this run's freshly seeded tracker.
        warnings.warn(
            "checkpoint RNG states come from a machine with"
            f"{'' if state.get('cuda_present') else 'out'} CUDA: dropout streams restart",
            stacklevel=1,  # points at this line, as it did without the argument
        )
        return
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
