"""run_control.py at step boundaries (one gloo rank): periodic saves and Hugging Face exports, a stop signal that
saves and stops, a save that would outlive torchrun's grace refused up front, and a collapsed or non-finite policy
never replacing the last good checkpoint."""

import signal
from types import SimpleNamespace

import torch

from tests._dist import run_distributed


def _control(health_refusal=None, **overrides):
    from remax_megatron.config import load_config
    from remax_megatron.run_control import RunControl

    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "trainer.steps=7",
            "checkpoint.save_every=3",
            "checkpoint.hf_every=2",
            *[f"{k}={v}" for k, v in overrides.items()],
        ],
    )
    actor = torch.nn.Linear(2, 2)
    parts = SimpleNamespace(actor=SimpleNamespace(module=actor))
    log = SimpleNamespace(lines=[])
    log.write = log.warn = log.lines.append
    run = RunControl(cfg, parts, None, log, SimpleNamespace(save_refusal=lambda: health_refusal))
    run.preempt.requested, run.preempt.signal_name, run.preempt.signum = False, "", 0  # the process's one flag
    events = []
    run.save = lambda step, state: events.append(("save", step, state)) or f"ckpt{step}"
    run.export_hf = lambda step: events.append(("export", step))
    return run, events, actor, log


def _body(rank, world):
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    run, events, actor, log = _control()
    for step in range(1, 8):
        assert run.after_step(step, lambda step=step: {"at": step})
    assert events == [
        ("export", 2),
        ("save", 3, {"at": 3}),
        ("export", 4),
        ("save", 6, {"at": 6}),
        ("export", 6),
        ("save", 7, {"at": 7}),
        ("export", 7),
    ]  # every 3 and 2 steps, and the last step

    # a stop signal: save now and stop, whatever the schedule
    run, events, actor, log = _control()
    run.preempt.signum, run.preempt.signal_name = int(signal.SIGUSR1), "SIGUSR1"
    assert not run.after_step(1, lambda: {"at": 1}) and events == [("save", 1, {"at": 1})]
    # ... unless plain torchrun would kill the save half-way: then nothing is saved
    os.environ.update(TORCHELASTIC_RUN_ID="x", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    for name in ("REMAX_LAUNCHER", "REMAX_LAUNCHER_PID"):
        os.environ.pop(name, None)
    run, events, actor, log = _control()
    run.preempt.signum, run.preempt.signal_name, run._save_seconds = int(signal.SIGTERM), "SIGTERM", 60.0
    assert not run.after_step(1, lambda: {}) and events == []
    os.environ.pop("TORCHELASTIC_RUN_ID")

    # the newest checkpoint stays when health.py refuses, or when the weights are no longer finite
    run, events, actor, log = _control(health_refusal="the policy collapsed")
    assert run.after_step(3, dict) and events == []
    assert log.lines[0].startswith("warning: not saving step 3: the policy collapsed; the newest checkpoint stays")
    run, events, actor, log = _control()
    with torch.no_grad():
        actor.weight[0, 0] = float("nan")
    assert run.save_if_sound(3, dict) is None and events == []
    assert "not saving step 3: the actor's weights hold NaN or inf" in log.lines[0]


def test_saves_exports_stops_and_refusals_at_step_boundaries():
    run_distributed(_body, world_size=1)
