"""Checkpoint faults on 2 gloo ranks (TP=2), with megatron's real dist_checkpointing:

- the free-space check finds a nearly full disk on rank 1 only: every rank refuses together
- the free-space check counts the whole checkpoint, not one rank's share
- a write that fails inside dist_checkpointing (torch's CheckpointException, a BaseException):
  one line on every rank, no `.tmp-*` left, the previous checkpoint loadable
- same-size corruption (first 4 KiB overwritten) found by the manifest's checksums; resume=auto
  falls back to the older checkpoint; a checkpoint of another model is refused naming both shapes

Faults are injected where the real code meets them: `shutil.disk_usage`, RLIMIT_FSIZE (the kernel
refuses writes past a size, as a full disk does), bytes overwritten on disk.
"""

import os
import re

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model


def _body(rank, world, model_dir, root):
    import shutil
    from collections import namedtuple

    from remax_megatron.checkpoint import CheckpointError, save_checkpoint
    from remax_megatron.config import OptimConfig
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.optimizer import build_optimizer, wrap_ddp
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=2, pp=1, world_size=world).initialize()
    actor = build_policy(read_hf_config(model_dir), tp=2, pp=1, init_weights=False)
    load_hf_weights(actor, model_dir)
    opt = build_optimizer(wrap_ddp(actor, False), OptimConfig(lr=1e-3))
    first = save_checkpoint(root, 1, actor, opt, {"note": "first"}, model_dir, keep=3)
    saved = {k: v.clone() for k, v in actor.state_dict().items() if not k.endswith("_extra_state")}

    real_usage = shutil.disk_usage
    usage = namedtuple("usage", "total used free")

    def nearly_full(path):
        return usage(10 << 30, (10 << 30) - 4096, 4096) if rank == 1 else real_usage(path)

    shutil.disk_usage = nearly_full
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)  # the failed save must not be what a resume finds
    with pytest.raises(CheckpointError, match="No space left on device|failed on another rank"):
        save_checkpoint(root, 2, actor, opt, {"note": "second"}, model_dir, keep=3)
    shutil.disk_usage = real_usage
    _assert_only_the_first_checkpoint(root, first, actor, opt, saved, check_listing=rank == 0)


def _assert_only_the_first_checkpoint(root, first, actor, opt, saved, check_listing=True):
    """After a failed second save: only step 1 and `latest` -> it; step 1 validates and restores `saved`."""
    from remax_megatron.checkpoint import load_checkpoint, validate

    if check_listing:
        assert sorted(os.listdir(root)) == ["latest", "step_000001"], os.listdir(root)
        assert open(os.path.join(root, "latest")).read() == "step_000001"
    validate(first)
    state = load_checkpoint(first, actor, opt)
    assert state["note"] == "first" and state["step"] == 1
    for k, v in actor.state_dict().items():
        if k in saved:
            assert torch.equal(v, saved[k]), k


@pytest.mark.slow
def test_disk_full_on_one_rank_keeps_previous_checkpoint(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "llama", hidden=32, layers=2, heads=2, kv_heads=2, ffn=64)
    run_distributed(_body, world_size=2, args=(model_dir, str(tmp_path / "ckpt")))


def _build(model_dir, world, hidden=None):
    from remax_megatron.config import OptimConfig
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.optimizer import build_optimizer, wrap_ddp
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        ParallelLayout(tp=2, pp=1, world_size=world).initialize()
    actor = build_policy(read_hf_config(model_dir), tp=2, pp=1, init_weights=False)
    load_hf_weights(actor, model_dir)
    return actor, build_optimizer(wrap_ddp(actor, False), OptimConfig(lr=1e-3))


def _files_size(path):
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def _whole_checkpoint_body(rank, world, model_dir, root):
    import shutil
    from collections import namedtuple

    from remax_megatron.checkpoint import CheckpointError, save_checkpoint

    actor, opt = _build(model_dir, world)
    measured = save_checkpoint(os.path.join(root, "measure"), 1, actor, opt, {}, model_dir, keep=1)
    size = _files_size(measured)
    share = 3 * sum(p.numel() * p.element_size() for p in actor.parameters()) + (1 << 20)
    assert share < 0.75 * size, (share, size)  # the model is big enough to tell a share from the total

    real_usage = shutil.disk_usage
    shutil.disk_usage = lambda path: namedtuple("usage", "total used free")(size * 4, size * 4, int(0.75 * size))
    try:
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(os.path.join(root, "fresh"), 1, actor, opt, {}, model_dir, keep=1)
    finally:
        shutil.disk_usage = real_usage
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message, message
    needed = float(message.split("needs about ")[1].split(" MiB")[0])
    assert needed * 2**20 >= size and "0.00 GiB" not in message, (message, size)
    assert os.listdir(os.path.join(root, "fresh")) == []  # nothing left behind


@pytest.mark.slow
def test_free_space_check_counts_the_whole_checkpoint(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "llama", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512)
    run_distributed(_whole_checkpoint_body, world_size=2, args=(model_dir, str(tmp_path / "ckpt")))


def _failing_write_body(rank, world, model_dir, root):
    import resource
    import signal

    from remax_megatron.checkpoint import CheckpointError, save_checkpoint

    actor, opt = _build(model_dir, world)
    first = save_checkpoint(root, 1, actor, opt, {"note": "first"}, model_dir, keep=3)
    saved = {k: v.clone() for k, v in actor.state_dict().items() if not k.endswith("_extra_state")}
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)
    # Rank 1 may write files of at most 8 KiB (its shards are bigger): the kernel refuses the rest
    # of a shard inside dist_checkpointing's writer, as a disk that fills during the save does.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(root, 2, actor, opt, {"note": "second"}, model_dir, keep=3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    message = str(info.value)
    # The same line on both ranks: the rank that failed and its error (torch's writer hides the errno).
    assert "\n" not in message and message.startswith(f"saving checkpoint {root}/step_000002 failed: rank 1: "), message
    _assert_only_the_first_checkpoint(root, first, actor, opt, saved)  # no .tmp-* on any rank


@pytest.mark.slow
def test_write_failing_inside_dist_checkpointing_is_cleaned_up(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "llama", hidden=64, layers=2, heads=2, kv_heads=2, ffn=128)
    run_distributed(_failing_write_body, world_size=2, args=(model_dir, str(tmp_path / "ckpt")))


def _corruption_body(rank, world, model_dir, other_dir, root):
    import warnings

    from megatron.core import parallel_state

    from remax_megatron.checkpoint import (
        CheckpointError,
        find_resume_checkpoint,
        load_checkpoint,
        save_checkpoint,
        validate,
    )

    actor, opt = _build(model_dir, world)
    older = save_checkpoint(root, 1, actor, opt, {}, model_dir, keep=3)
    newest = save_checkpoint(root, 2, actor, opt, {}, model_dir, keep=3)
    if rank == 0:
        shards = [
            os.path.join(newest, "model", f) for f in os.listdir(os.path.join(newest, "model")) if f.endswith(".distcp")
        ]
        shard = max(shards, key=os.path.getsize)
        size = os.path.getsize(shard)
        assert size > 4096
        with open(shard, "r+b") as f:  # same size, first 4 KiB overwritten
            f.write(b"\x5a" * 4096)
        assert os.path.getsize(shard) == size
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match=r"\.distcp does not match its checksum in manifest.json") as info:
        validate(newest)
    assert "\n" not in str(info.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert find_resume_checkpoint(root, "auto") == older
    skipped = [str(w.message) for w in caught if "skipping invalid checkpoint" in str(w.message)]
    assert len(skipped) == (1 if rank == 0 else 0), skipped  # once, from rank 0
    load_checkpoint(older, actor, opt)
    # A problem only one rank sees (a node whose view of the filesystem lags, here faked on rank 1): every
    # rank still gets the same verdict and picks the same checkpoint (no rank waits in another collective).
    from unittest import mock

    real_getsize = os.path.getsize
    with mock.patch("os.path.getsize", lambda p: real_getsize(p) + (1 if rank == 1 and p.startswith(older) else 0)):
        with pytest.raises(CheckpointError, match="bytes, the manifest says"):
            validate(older)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert find_resume_checkpoint(root, "auto") is None  # newest corrupt, older bad on rank 1

    other, other_opt = _build(other_dir, world)  # another model: hidden 48 instead of 32
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(older, other, other_opt)
    message = str(info.value)
    assert "\n" not in message and "holds a different model" in message, message
    assert re.search(r"has shape \[[\d, ]*32\] there and \[[\d, ]*48\] in this model", message), message
    parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_same_size_corruption_is_found_and_auto_falls_back(tmp_path):
    from remax_megatron.checkpoint import CheckpointError, validate

    model_dir = make_tiny_model(str(tmp_path / "m"), "llama", hidden=32, layers=2, heads=2, kv_heads=2, ffn=64)
    other_dir = make_tiny_model(str(tmp_path / "o"), "llama", hidden=48, layers=2, heads=2, kv_heads=2, ffn=64)
    root = str(tmp_path / "ckpt")
    run_distributed(_corruption_body, world_size=2, args=(model_dir, other_dir, root))
    # Outside torch.distributed one process reads every file.
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        validate(os.path.join(root, "step_000002"))
    validate(os.path.join(root, "step_000001"))


def test_manifest_of_sizes_only_still_validates(tmp_path):
    """Checkpoints written before checksums (manifest: file -> size) are still accepted by size."""
    import json

    from remax_megatron.checkpoint import CheckpointError, validate

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"model/__0_0.distcp": 100}}))
    validate(str(tmp_path))
    (tmp_path / "model" / "__0_0.distcp").write_bytes(b"x" * 99)
    with pytest.raises(CheckpointError, match="has 99 bytes, the manifest says 100"):
        validate(str(tmp_path))


def test_a_save_longer_than_torchruns_kill_grace_is_refused_with_the_numbers():
    from remax_megatron.checkpoint import preemption_save_refusal

    plain = {"TORCHELASTIC_RUN_ID": "x"}
    why = preemption_save_refusal("SIGTERM", 45.0, plain)
    assert why.startswith("not saving: the last save took 45 s and plain torchrun kills its workers 30 s after")
    assert "60 s" in preemption_save_refusal("SIGTERM", 70.0, dict(plain, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60"))
    assert preemption_save_refusal("SIGTERM", 20.0, plain) is None  # fits in the grace
    assert preemption_save_refusal("SIGTERM", 0.0, plain) is None  # no save measured yet
    assert preemption_save_refusal("SIGUSR1", 45.0, plain) is None  # torchrun ignores it
    assert preemption_save_refusal("SIGTERM", 45.0, dict(plain, REMAX_LAUNCHER="1")) is None  # waits for us
    assert preemption_save_refusal("SIGTERM", 45.0, {}) is None  # no torchrun at all
    assert preemption_save_refusal("SIGTERM", 45.0, plain, parent_pid=os.getppid() + 1) is None  # launcher gone
