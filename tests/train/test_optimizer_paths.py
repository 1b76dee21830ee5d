"""The optimizer interface's CPU path (CpuAdamW) against an fp64 AdamW step on the same fixed gradients,
through tests/gpu/optimizer_step.py: the script tools/gpu_check.sh also runs on a GPU (megatron's
DistributedOptimizer) to compare the two paths. fp32 and bf16 (fp32 main weights)."""

import os
import subprocess
import sys

import pytest
import torch

from tools.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def expected_after(before, grads, dtype, lr=1e-3, wd=0.1, clip=1.0):
    """fp64 AdamW (torch's update rule, first step) with megatron's clipping and wd groups."""
    from remax_megatron.config import OptimConfig

    cfg = OptimConfig()
    b1, b2, eps = cfg.beta1, cfg.beta2, cfg.eps
    norm = sum(g.double().pow(2).sum() for g in grads.values()).sqrt()
    scale = min(1.0, clip / (float(norm) + 1e-6))
    out = {}
    for name, w in before.items():
        w, g = w.double(), grads[name].double() * scale
        decay = 0.0 if (w.dim() == 1 or name.endswith(".bias")) else wd
        m, v = (1 - b1) * g, (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1), v / (1 - b2)
        out[name] = w * (1 - lr * decay) - lr * m_hat / (v_hat.sqrt() + eps)
    return out


def run_step(model_dir, dtype, out, cuda_visible=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("MASTER_ADDR", None)
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    r = subprocess.run(
        [sys.executable, "-m", "tests.gpu.optimizer_step", "--model-dir", model_dir, "--dtype", dtype, "--out", out],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_optimizer_step_equals_fp64_adamw(tmp_path, dtype):
    model_dir = make_tiny_model(
        str(tmp_path / "m"), "qwen2", hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=200, seed=4
    )
    res = run_step(model_dir, dtype, str(tmp_path / "cpu.pt"), cuda_visible="")
    assert res["optimizer"] == "CpuAdamW" and not res["cuda"]
    want = expected_after(res["before"], res["grads"], torch.float32)
    # the global grad norm (what clipping divides by) in fp64: an fp32 sum is off by ~1e-4 on big grads
    norm = float(sum(g.double().pow(2).sum() for g in res["grads"].values()).sqrt())
    assert abs(res["grad_norm"] - norm) <= 1e-12 * norm, (res["grad_norm"], norm)
    assert any(n.endswith(".bias") for n in want) and any(w.dim() == 1 for w in want.values())
    for name, got in res["after"].items():
        assert got.dtype == getattr(torch, dtype), name
        if dtype == "float32":
            err = (got.double() - want[name]).abs().max().item()
            assert err < 1e-6, f"{name}: {err}"  # the step moves weights by ~1e-3
        else:
            # bf16 weights are the fp32 main weights rounded: within half a bf16 ulp of the fp64 step
            ulp = torch.finfo(torch.bfloat16).eps * want[name].abs().clamp(min=1e-30)
            assert ((got.double() - want[name]).abs() <= 0.5 * ulp * 1.01 + 1e-7).all(), name


@pytest.mark.parametrize("shape", [(7,), (1 << 20,), (3000, 700)])
def test_grad_norm_in_chunks_is_the_fp64_norm(shape):
    """The clip's norm: fp64 accumulation over 1M-entry chunks equals the norm of the fp64 copy
    (2.1M entries of very different sizes: an fp32 accumulation is off by far more than 1e-12)."""
    from remax_megatron.optimizer import fp64_norm

    g = torch.Generator().manual_seed(0)
    grad = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])
    want = grad.double().norm().item()
    assert abs(fp64_norm(grad).item() - want) <= 1e-12 * want


def test_resume_steps_with_this_codes_adamw_not_the_checkpoints():
    """torch's load_state_dict restores each saved group's hyperparameters, the implementation flags
    included: a checkpoint written with foreach AdamW (before 94e3fc8) must resume fused, and its next
    step must equal the uninterrupted run's, bitwise."""
    import copy
    import types

    from remax_megatron.config import OptimConfig
    from remax_megatron.optimizer import CpuAdamW

    def build():
        torch.manual_seed(0)
        module = torch.nn.Linear(8, 4)
        ddp = types.SimpleNamespace(module=module, zero_grad_buffer=lambda: None)
        return CpuAdamW(ddp, OptimConfig(), process_groups=types.SimpleNamespace(mp=None))

    def step(opt, seed):
        torch.manual_seed(seed)
        for main in opt.main_params:
            main.grad = torch.randn_like(main)
        opt.optimizer.step()

    straight = build()
    step(straight, 1)
    state = copy.deepcopy(straight.optimizer.state_dict())
    for group in state["param_groups"]:  # as a checkpoint written before 94e3fc8 holds them
        group.update(foreach=True, fused=None)
    steps = {float(s.pop("step")) for s in state["state"].values()}  # CpuAdamW saves one common step
    state["state"]["common_step"] = steps.pop()

    resumed = build()
    with torch.no_grad():  # the weights come from the model checkpoint
        for mine, theirs in zip(resumed.main_params, straight.main_params):
            mine.copy_(theirs)
    resumed.load_sharded_state_dict(state)
    assert all(g["fused"] is True and g["foreach"] is None for g in resumed.param_groups), resumed.param_groups
    step(straight, 2)
    step(resumed, 2)
    for a, b in zip(resumed.main_params, straight.main_params):
        assert torch.equal(a, b)


def test_a_resume_takes_the_schedule_and_adam_settings_from_its_config():
    """A 4-update linear schedule to min_lr 0, resumed with 8 updates and another lr and beta2: the update
    count comes from the checkpoint, everything else from the new config (megatron's default kept the
    checkpoint's: lr 0 on every new step, the old lr), and what changed is listed."""
    import types

    from remax_megatron.config import load_config
    from remax_megatron.optimizer import CpuAdamW, build_scheduler, restore_config_hyperparameters, schedule_changes

    def build(*overrides, updates):
        cfg = load_config(
            None, ["reward.functions=[exact_match]", "optim.schedule=linear", "optim.min_lr=0", *overrides]
        ).optim
        torch.manual_seed(0)
        ddp = types.SimpleNamespace(module=torch.nn.Linear(8, 4), zero_grad_buffer=lambda: None)
        opt = CpuAdamW(ddp, cfg, process_groups=types.SimpleNamespace(mp=None))
        return cfg, opt, build_scheduler(opt, cfg, updates)

    _, first, schedule = build("optim.lr=1e-3", updates=4)
    for _ in range(4):
        schedule.step(increment=1)
    assert first.param_groups[0]["lr"] == 0.0  # the first run's schedule ended
    saved_schedule, saved_adam = schedule.state_dict(), first.optimizer.state_dict()

    cfg, resumed, schedule = build("optim.lr=2e-3", "optim.beta2=0.99", updates=8)
    resumed.optimizer.load_state_dict(saved_adam)  # what load_checkpoint does: the saved groups' betas come back
    changes = restore_config_hyperparameters(resumed, cfg) + schedule_changes(saved_schedule, schedule)
    schedule.load_state_dict(saved_schedule)
    assert schedule.num_steps == 4
    assert resumed.param_groups[0]["lr"] == pytest.approx(2e-3 * (1 - 4 / 8))  # > 0, from the new lr
    assert resumed.param_groups[0]["betas"] == (0.9, 0.99)
    assert changes == [
        "optim.beta1, optim.beta2 (0.9, 0.99) (checkpoint: (0.9, 0.999))",
        "optim.lr 0.002 (checkpoint: 0.001)",
        "trainer.steps * trainer.mini_batches 8 (checkpoint: 4)",
    ]
    schedule.step(increment=1)
    assert resumed.param_groups[0]["lr"] == pytest.approx(2e-3 * (1 - 5 / 8))


def test_saving_leaves_the_live_adam_state_as_it_was(monkeypatch):
    """sharded_state_dict adds the fp32 main weights of bf16 parameters to what it saves, not to torch's
    own per-parameter state (whose dicts torch's state_dict() returns as they are)."""
    import types

    from remax_megatron import optimizer as optimizer_module
    from remax_megatron.config import OptimConfig

    monkeypatch.setattr(optimizer_module, "get_param_id_to_sharded_param_map", lambda *a: {})
    monkeypatch.setattr(optimizer_module, "optim_state_to_sharding_state", lambda *a, **k: None)
    module = torch.nn.Linear(8, 4).to(torch.bfloat16)
    ddp = types.SimpleNamespace(module=module, zero_grad_buffer=lambda: None)
    opt = optimizer_module.CpuAdamW(ddp, OptimConfig(), process_groups=types.SimpleNamespace(mp=None))
    saved = opt.sharded_state_dict({})
    assert all("fp32_param" in saved["state"][i] for i in range(2))  # both parameters are bf16
    assert [sorted(s) for s in opt.optimizer.state.values()] == [["exp_avg", "exp_avg_sq", "step"]] * 2
