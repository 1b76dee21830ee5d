"""The tiny agent default in other layouts (a file of its own so that pytest-xdist runs it beside
test_agent_default.py): on separate rollout ranks one step ahead (staleness 1), and with LoRA at DP=2 with the
native engine, greedy eval goes from <= 0.2 to >= 0.8 within 40 steps."""

import os

import pytest

from tests._needs import engine_overrides
from tests.train.test_agent_default import CONFIG, assert_learns_the_tool
from tests.train.test_train_e2e import _train_logged


@pytest.fixture(scope="module")
def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ("rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=1", "actor.tp=2"), id="separate"
        ),
        pytest.param(
            ("actor.tp=1", "rollout.engine=native", "actor.lora_rank=4", "actor.lora_alpha=16", "optim.lr=1e-3"),
            id="lora-dp2-native",
        ),
    ],
)
def test_the_agent_default_learns_in_other_layouts(env, tmp_path, layout):
    nproc = 3 if "rollout.placement=separate" in layout else 2
    records, _, _ = _train_logged(env, CONFIG, str(tmp_path / "run"), *engine_overrides(), *layout, nproc=nproc)
    evals, train = assert_learns_the_tool(records)
    if nproc == 3:  # the engine samples with the weights of one update before (the rollout ran a step ahead)
        assert [r["rollout/staleness"] for r in train[:3]] == [0, 1, 1], [r.get("rollout/staleness") for r in train]
