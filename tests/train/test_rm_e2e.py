"""configs/tiny_cpu_rm.yaml end to end under torchrun (shortened to 15 steps): the reward model's score
of greedy eval answers rises. A file of its own: the suite's longest test, so pytest-xdist's
per-file scheduling (--dist loadfile) can run it beside tests/train/test_train_e2e.py."""

import pytest

from tests.train.test_train_e2e import _train, env  # noqa: F401 (env: the fixture)


@pytest.mark.slow
def test_tiny_reward_model_default_learns(env, tmp_path):  # noqa: F811
    records = _train(env, "configs/tiny_cpu_rm.yaml", str(tmp_path / "rm"), "trainer.steps=15",
                     "trainer.eval_every=15")
    evals = [r for r in records if "eval/reward_mean" in r]
    assert evals[-1]["eval/reward_mean"] - evals[0]["eval/reward_mean"] >= 0.2, evals
    assert all("reward/model_mean" in r for r in records if "loss" in r)
