"""Packed rows on the GPU (issue 29; collected only with CUDA; run by tools/gpu_check.sh, step packing).

With Transformer Engine's layer spec the trainer packs with TE's THD format (megatron's PackedSeqParams:
every sequence of a micro-batch back to back in one row, cu_seqlens marking where each starts; RoPE restarts
per sequence). Here the log-probs of a packed micro-batch equal those of the same sequences right-padded, in
bf16 (TE's THD attention runs in its flash / cuDNN backends), and so do the loss, grad norm and the updated
weights of one update. Without TE the same THD rows go through models/attention.py (each document through
SDPA alone), which this test then checks on the GPU.
"""

import pytest
import torch

from tests._dist import run_distributed
from tests.train.test_update import _var_batch
from tools.make_tiny_model import make_tiny_model

VARIANTS = {
    "fixed": ["trainer.micro_batch_size=2"],
    "packed": [
        "trainer.micro_batch_tokens=32",
        "trainer.pack_sequences=true",
        "data.max_prompt_tokens=4",
        "rollout.max_new_tokens=8",
    ],
}


def _bf16_trainer(world, model_dir, overrides):
    """tests/train/test_update.py's _trainer in bf16 with megatron's mixed-precision optimizer."""
    from types import SimpleNamespace

    from remax_megatron.config import load_config
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.optimizer import attach_to_schedule, build_optimizer, build_scheduler, wrap_ddp
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.trainer import Trainer
    from remax_megatron.weights import load_hf_weights

    groups = ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    cfg = load_config(None, ["reward.functions=[exact_match]", "optim.distributed_optimizer=false", *overrides])
    actor = build_policy(read_hf_config(model_dir), tp=1, pp=1, init_weights=False, params_dtype=torch.bfloat16)
    load_hf_weights(actor, model_dir)
    ddp = wrap_ddp(actor, False)
    opt = build_optimizer(ddp, cfg.optim, torch.bfloat16, groups)
    attach_to_schedule(ddp, opt)
    parts = SimpleNamespace(
        cfg=cfg,
        groups=groups,
        actor=ddp,
        optimizer=opt,
        scheduler=build_scheduler(opt, cfg.optim, 10),
        kl=SimpleNamespace(coef=0.0),
    )
    return Trainer(parts, logger=None), actor


def _thd_body(rank, world, model_dir, out_path):
    from remax_megatron.weights import export_hf_weights

    results = {}
    for variant, overrides in VARIANTS.items():
        trainer, actor = _bf16_trainer(
            world, model_dir, [*overrides, "optim.lr=1e-3", "optim.grad_clip=0", "actor.dtype=bfloat16"]
        )
        batch = _var_batch()
        batch, plan = trainer.updater.micro_batch_plan(batch)
        micro = trainer.updater.micro_batches(batch, [m for update in plan for m in update])
        if variant == "packed":
            assert all("cu_seqlens" in mb and mb["input_ids"].shape[0] == 1 for mb in micro if "unpack" in mb)
        logprobs = trainer.updater.logprobs(actor, batch, plan)
        update = trainer.updater.train_on(batch, None, None, plan)
        results[variant] = {
            "logprobs": logprobs,
            "mask": batch["response_mask"],
            "stats": update.stats,
            "weights": {n: t.float().cpu() for n, t in export_hf_weights(actor)},
        }
    torch.save(results, out_path)


@pytest.mark.slow
def test_thd_packed_rows_equal_padded_rows_in_bf16(tmp_path):
    model_dir = make_tiny_model(
        str(tmp_path / "llama"), "llama", hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, seed=7
    )
    out = str(tmp_path / "thd.pt")
    run_distributed(_thd_body, world_size=1, args=(model_dir, out))
    runs = torch.load(out)
    fixed, packed = runs["fixed"], runs["packed"]
    mask = fixed["mask"]
    # the rows' order is the batch's in both (one rank: nothing moves), so the log-probs compare row by row
    diff = (fixed["logprobs"] - packed["logprobs"])[mask].abs()
    assert diff.max() < 5e-2 and diff.mean() < 5e-3, (diff.max(), diff.mean())
    assert abs(fixed["stats"]["loss"] - packed["stats"]["loss"]) < 2e-2 * max(1.0, abs(fixed["stats"]["loss"]))
    assert abs(fixed["stats"]["grad_norm"] - packed["stats"]["grad_norm"]) < 5e-2 * fixed["stats"]["grad_norm"]
    worst = max((fixed["weights"][k] - packed["weights"][k]).abs().max().item() for k in fixed["weights"])
    assert worst < 5e-3, worst
