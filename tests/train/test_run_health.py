"""The real `Trainer.fit` (one process, native engine, tiny random Llama) when a run is not learning,
goes non-finite, or is resumed with another schedule (issue 31 items 2, 7, 8):

- rollout.top_k=1: sampling is greedy, every sample ties with its greedy reward; after
  trainer.no_signal_steps steps one warning on stderr names rollout.top_k=1
- a NaN reward at step 2: its update is skipped and counted (optim/skipped_updates, one line), and the
  end-of-run checkpoint holds step 1's finite weights
- that checkpoint resumed with trainer.steps doubled and another optim.lr under a linear schedule to
  0: the new steps train at lr > 0 from the new lr, and the change is said once

The policy collapsing to uniform (optim.lr=1e3 on the warm-started default): tests/train/test_faults.py.
"""

import contextlib
import io
import math

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model


class NanOnSecondStep:
    """Rewards from the response's position (non-zero advantages); NaN for one sample at step 2,
    after keeping the actor's weights as they are then (step 1's update done)."""

    reward_model = None

    def __init__(self, actor):
        self.actor, self.calls, self.weights_after_step_1 = actor, 0, None

    def score(self, prompts, responses, wait=None, response_columns=None):
        self.calls += 1
        rows = [[float(j) for j in range(len(row))] for row in responses]
        if self.calls == 2:
            self.weights_after_step_1 = {n: p.detach().clone() for n, p in self.actor.named_parameters()}
            rows[0][0] = float("nan")
        return rows, {}


def _fit(cfg_overrides, world, scorer=None, resume=None):
    """Build a trainer for the overrides and fit it; (trainer, stdout, stderr)."""
    from megatron.core import parallel_state

    from remax_megatron.config import load_config
    from remax_megatron.metrics import MetricsLogger
    from remax_megatron.startup import build, check_inputs
    from remax_megatron.trainer import Trainer

    cfg = load_config(None, cfg_overrides)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parts = build(cfg, check_inputs(cfg, world))
    if scorer is not None:
        parts.scorer = scorer(parts.actor.module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        logger = MetricsLogger(cfg.trainer.output_dir, cfg.trainer.steps, tensorboard=False, progress_bar=False)
        trainer = Trainer(parts, logger)
        trainer.records = []
        log = logger.log
        logger.log = lambda record: trainer.records.append(record) or log(record)
        trainer.fit(resume=resume)
        logger.close()
    return trainer, out.getvalue(), err.getvalue()


def _body(rank, world, model_dir, top, result_path):
    from remax_megatron.checkpoint import load_checkpoint

    common = [
        f"actor.model={model_dir}",
        "rollout.engine=native",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "reward.functions=[exact_match]",
        "trainer.prompts_per_step=4",
        "trainer.micro_batch_size=4",
        "trainer.eval_every=0",
        "data.max_prompt_tokens=64",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "optim.schedule=linear",
        "optim.min_lr=0",
    ]
    result = {}

    _, _, err = _fit(
        common
        + ["rollout.top_k=1", "trainer.steps=2", "trainer.no_signal_steps=2", f"trainer.output_dir={top}/greedy"],
        world,
    )
    result["greedy_stderr"] = err

    trainer, out, err = _fit(
        common + ["trainer.steps=2", "optim.lr=1e-2", f"trainer.output_dir={top}/nan"], world, scorer=NanOnSecondStep
    )
    result.update(nan_stdout=out, nan_stderr=err, nan_records=trainer.records)
    kept = trainer.parts.scorer.weights_after_step_1
    now = {n: p.detach().clone() for n, p in trainer.actor_module.named_parameters()}
    result["skipped_kept_weights"] = all(torch.equal(now[n], kept[n]) for n in kept)  # step 2 changed nothing
    with torch.no_grad():
        for p in trainer.actor_module.parameters():
            p.add_(1.0)  # whatever the checkpoint holds must come back, not this
    load_checkpoint(f"{top}/nan/checkpoints/step_000002", trainer.actor_module, trainer.parts.optimizer)
    result["checkpoint_is_step_1"] = all(torch.equal(p, kept[n]) for n, p in trainer.actor_module.named_parameters())
    result["step_1_moved"] = trainer.records[0]["grad_norm"] > 0

    trainer, out, err = _fit(
        common + ["trainer.steps=4", "optim.lr=2e-2", f"trainer.output_dir={top}/nan"],
        world,
        resume=f"{top}/nan/checkpoints/step_000002",
    )
    result.update(resumed_stdout=out, resumed_records=trainer.records)
    torch.save(result, result_path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    top = tmp_path_factory.mktemp("health")
    model = make_tiny_model(str(top / "llama"), "llama", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, seed=4)
    run_distributed(_body, world_size=1, args=(model, str(top), str(top / "result.pt")))
    return torch.load(top / "result.pt", weights_only=False)


@pytest.mark.slow
def test_greedy_sampling_warns_once_naming_top_k(run):
    lines = [line for line in run["greedy_stderr"].splitlines() if "learning signal" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: no learning signal for 2 steps (steps 1-2)"), run[
        "greedy_stderr"
    ]
    assert "likely cause: rollout.top_k=1 makes sampling greedy decoding" in lines[0]


@pytest.mark.slow
def test_a_nan_update_is_skipped_and_the_checkpoint_keeps_the_last_finite_weights(run):
    first, second = run["nan_records"]
    assert first["optim/skipped_updates"] == 0 and second["optim/skipped_updates"] == 1
    assert math.isnan(second["loss"])
    assert "step 2: skipped an update (grad norm nan): the weights stay as they were" in run["nan_stdout"]
    assert run["step_1_moved"] and run["skipped_kept_weights"]
    assert run["checkpoint_is_step_1"]


@pytest.mark.slow
def test_a_resume_follows_the_schedule_it_is_given(run):
    assert [r["step"] for r in run["resumed_records"]] == [3, 4]
    # 2 of 4 updates were counted before (the skipped one is not an update): lr 2e-2 * (1 - u / 4) after update u
    assert [r["lr"] for r in run["resumed_records"]] == pytest.approx([2e-2 * 2 / 4, 2e-2 * 1 / 4])
    lines = [line for line in run["resumed_stdout"].splitlines() if line.startswith("resume: ")]
    assert lines == [
        "resume: following this run's config, not the checkpoint's: optim.lr 0.02 (checkpoint: 0.01); "
        "trainer.steps * trainer.mini_batches 4 (checkpoint: 2); lr 0.015 at update 1"
    ], run["resumed_stdout"]
