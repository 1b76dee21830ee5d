"""checkpoint.keep: after each save only the newest `keep` checkpoints are left, and they load; the
saves leave no helper process behind (megatron's results Manager would cost each rank 2-4 s)."""

import multiprocessing
import os

import pytest

from tests._dist import run_distributed
from tests.checkpoint.test_save_faults import _build
from tools.make_tiny_model import make_tiny_model


def _keep_body(rank, world, model_dir, root):
    import torch.distributed as dist

    from remax_megatron.checkpoint import find_resume_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

    actor, opt = _build(model_dir, world)
    listings = []
    for step in (1, 2, 3, 4):
        save_checkpoint(root, step, actor, opt, {"note": step}, model_dir, keep=2)
        dist.barrier()
        listings.append(list_checkpoints(root))
    # synchronous saves: the write results stay in this process (weights.megatron_ckpt.save_sharded)
    assert multiprocessing.active_children() == [], multiprocessing.active_children()
    assert listings == [
        ["step_000001"],
        ["step_000001", "step_000002"],
        ["step_000002", "step_000003"],
        ["step_000003", "step_000004"],
    ], listings
    assert sorted(os.listdir(root)) == ["latest", "step_000003", "step_000004"], os.listdir(root)  # nothing else
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step_000004"
    for name in ("step_000003", "step_000004"):
        assert load_checkpoint(os.path.join(root, name), actor, opt)["note"] == int(name[-1])
    assert find_resume_checkpoint(root, "auto") == os.path.join(root, "step_000004")


@pytest.mark.slow
def test_keep_prunes_to_the_newest_checkpoints(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)
    run_distributed(_keep_body, world_size=2, args=(model_dir, str(tmp_path / "ckpt")))
