"""Training checkpoints: atomic, validated, resumable at another TP/PP layout.

    <checkpoint.dir>/
      step_000006/
        model/             megatron dist_checkpointing of the actor (layout-free)
        optimizer/         dist_checkpointing of the Adam state, sharded like the params
        hf_config/         config.json + tokenizer of the actor (tools/convert_megatron_to_hf.py)
        rng/rank_<r>.pt    every rank's RNG states
        trainer_state.json step, data-loader position, LR scheduler, KL controller, counters
        remax_checkpoint.json
        manifest.json      every file and its size, written last: a checkpoint without it is incomplete
      latest               name of the newest complete checkpoint (updated after the rename)

A save writes into `.tmp-step_…` and renames it into place only when every rank
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

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import all_reduce_cpu
from remax_megatron.weights.megatron_ckpt import load_model, save_model

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MANIFEST, LATEST, TRAINER_STATE = "manifest.json", "latest", "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---- saving ------------------------------------------------------------------------------------


def save_checkpoint(root: str, step: int, model, optimizer, trainer_state: dict, hf_dir: str, keep: int) -> str:
    """Collective: write checkpoint `step` under `root`; returns its path. Raises CheckpointError on failure."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(root, step_dir_name(step))
    tmp, error = [None], None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            tmp[0] = tempfile.mkdtemp(prefix=f".tmp-{step_dir_name(step)}-", dir=root)
        except OSError as e:
            error = e
    dist.broadcast_object_list(tmp, src=0)
    _agree(error, f"cannot create a checkpoint directory in {root}")
    # Every rank checks it can write and has room before any collective write starts: a rank that
    # failed inside dist_checkpointing.save would leave the others waiting in its collectives.
    try:
        _preflight(tmp[0], _local_bytes(model, optimizer))
    except OSError as e:
        error = e
    try:
        _agree(error, f"cannot save checkpoint {final}")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
        raise
    try:
        save_model(model, tmp[0], hf_dir)
        optim_dir = os.path.join(tmp[0], "optimizer")
        if rank == 0:
            os.makedirs(optim_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(optimizer.sharded_state_dict(model.sharded_state_dict()), optim_dir)
        os.makedirs(os.path.join(tmp[0], "rng"), exist_ok=True)
        torch.save(rng_state(), os.path.join(tmp[0], "rng", f"rank_{rank}.pt"))
        if rank == 0:
            _write_json(os.path.join(tmp[0], TRAINER_STATE), {**trainer_state, "step": step,
                                                               "world_size": dist.get_world_size()})
    except Exception as e:  # noqa: BLE001 - every rank must learn about any rank's failure
        error = e
    try:
        _agree(error, f"saving checkpoint {final} failed")
        dist.barrier()
        error = None
        if rank == 0:
            try:
                _write_json(os.path.join(tmp[0], MANIFEST), _list_files(tmp[0]))
                if os.path.exists(final):  # a re-save of the same step (e.g. after a fallback)
                    shutil.rmtree(final)
                os.rename(tmp[0], final)
                _write_text_atomic(os.path.join(root, LATEST), step_dir_name(step))
            except OSError as e:
                error = e
        _agree(error, f"finishing checkpoint {final} failed")
    except CheckpointError:
        if rank == 0 and tmp[0]:
            shutil.rmtree(tmp[0], ignore_errors=True)
        raise
    if rank == 0:
        _prune(root, keep)
    dist.barrier()
    return final


def _local_bytes(model, optimizer) -> int:
    """Bytes this rank writes: its weight shards and two Adam moments of the same size, plus slack."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) + (1 << 20)


def _preflight(directory: str, need: int) -> None:
    """Raise OSError when this rank cannot write `need` bytes into `directory`."""
    probe = os.path.join(directory, f".probe-{dist.get_rank()}")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
        f.flush()
        os.fsync(f.fileno())
    os.remove(probe)
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(errno.ENOSPC, f"No space left on device: {need / 2**30:.2f} GiB needed, "
                                    f"{free / 2**30:.2f} GiB free in {directory}")


def _agree(error: Exception | None, what: str) -> None:
    """Raise on every rank when any rank failed (no rank is left waiting in a collective)."""
    flag = all_reduce_cpu(torch.tensor([0 if error is None else 1], dtype=torch.int32))
    if flag.item():
        reason = f"{type(error).__name__}: {error}" if error is not None else "failed on another rank"
        raise CheckpointError(f"{what}: {reason}")


def _write_json(path: str, data) -> None:
    _write_text_atomic(path, json.dumps(data, indent=2))


def _write_text_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _list_files(top: str) -> dict:
    files = {}
    for dirpath, _, names in os.walk(top):
        for name in names:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, top)] = os.path.getsize(path)
    return {"files": files}


def _prune(root: str, keep: int) -> None:
    for name in list_checkpoints(root)[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- finding and validating --------------------------------------------------------------------


def list_checkpoints(root: str) -> list[str]:
    """Checkpoint directory names under root, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((n for n in os.listdir(root) if STEP_DIR.match(n)), key=lambda n: int(STEP_DIR.match(n)[1]))


def validate(path: str) -> None:
    """Raise CheckpointError naming the first missing, truncated or unexpected file of `path`."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        raise CheckpointError(f"{manifest} is missing: checkpoint {path} is incomplete")
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{manifest} is unreadable ({e})") from None
    for rel, size in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full} is missing from checkpoint {path}")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"{full} has {os.path.getsize(full)} bytes, the manifest says {size}: "
                                  "the checkpoint is truncated or corrupted")


def find_resume_checkpoint(root: str, resume: str) -> str | None:
    """resume=none -> None; a path -> that checkpoint (validated); auto -> the newest valid one under root."""
    if resume == "none":
        return None
    if resume != "auto":
        validate(resume)
        return resume
    for name in reversed(list_checkpoints(root)):
        path = os.path.join(root, name)
        try:
            validate(path)
            return path
        except CheckpointError as e:
            warnings.warn(f"skipping invalid checkpoint: {e}", stacklevel=2)
    return None


# ---- loading -----------------------------------------------------------------------------------


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Collective: load weights and optimizer state (any TP/PP layout); returns the trainer state."""
    from megatron.core import dist_checkpointing

    load_model(model, path)
    try:
        state = dist_checkpointing.load(optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True),
                                        os.path.join(path, "optimizer"))
        optimizer.load_sharded_state_dict(state)
    except Exception as e:  # noqa: BLE001 - the message says what was reset
        raise CheckpointError(f"optimizer state in {path}/optimizer could not be loaded ({type(e).__name__}: {e}); "
                              "resume with checkpoint.resume=none to start fresh") from None
    with open(os.path.join(path, TRAINER_STATE)) as f:
        trainer_state = json.load(f)
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt")
    if trainer_state.get("world_size") == dist.get_world_size() and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states(), "cuda_present": torch.cuda.is_available()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda_present", False) != torch.cuda.is_available():
        # The tracker holds CUDA generator states on GPU and CPU ones on CPU (parallel/cpu_compat):
        # a checkpoint from the other kind of machine keeps this run's freshly seeded tracker.
        warnings.warn("checkpoint RNG states come from a machine with"
                      f"{'' if state.get('cuda_present') else 'out'} CUDA: dropout streams restart")
        return
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
