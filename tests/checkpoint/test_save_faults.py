"""A save that fails on one rank (disk full) leaves the previous checkpoint intact and loadable.

The fault is injected where the real check reads it: `shutil.disk_usage` reports a nearly full
disk on rank 1 only; every rank must refuse the save together (no rank left in a collective).
"""

import os

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model


def _body(rank, world, model_dir, root):
    import shutil
    from collections import namedtuple

    from remax_megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, validate
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
            p.add_(1.0)   # the failed save must not be what a resume finds
    with pytest.raises(CheckpointError, match="No space left on device|failed on another rank"):
        save_checkpoint(root, 2, actor, opt, {"note": "second"}, model_dir, keep=3)
    shutil.disk_usage = real_usage
    if rank == 0:
        assert sorted(os.listdir(root)) == ["latest", "step_000001"], os.listdir(root)
        assert open(os.path.join(root, "latest")).read() == "step_000001"
    validate(first)
    state = load_checkpoint(first, actor, opt)
    assert state["note"] == "first" and state["step"] == 1
    for k, v in actor.state_dict().items():
        if k in saved:
            assert torch.equal(v, saved[k]), k


def test_disk_full_on_one_rank_keeps_previous_checkpoint(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "m"), "llama", hidden=32, layers=2, heads=2, kv_heads=2, ffn=64)
    run_distributed(_body, world_size=2, args=(model_dir, str(tmp_path / "ckpt")))
