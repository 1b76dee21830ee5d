"""A third rollout engine is one `register_engine` call plus its own class: the config, the input
checks, the planner's checks and construction all find it there (nothing else names engines)."""

import pytest

from remax_megatron.config import load_config
from remax_megatron.rollout import RolloutEngine
from remax_megatron.rollout.engine import Completion, PromptRollout
from remax_megatron.rollout.factory import ENGINES, build_engine, check_rollout, register_engine


class ToyEngine(RolloutEngine):
    """Answers every prompt with its own first token, log-prob 0."""

    name = "toy"
    checked: list = []

    @staticmethod
    def check_config(cfg, arch, world_size):
        ToyEngine.checked.append((cfg.engine, world_size))
        if cfg.n > 4:
            raise ValueError(f"rollout.n={cfg.n}: the toy engine samples at most 4")

    def __init__(self, cfg, *, hf_dir, seed=0, dtype=None, max_model_len=None):
        super().__init__(seed)
        self.hf_dir = hf_dir

    def _generate(self, prompts, n, sampling, seeds):
        def echo(p):
            return Completion(token_ids=[p[0]], logprobs=[0.0], finish_reason="length")

        return [PromptRollout(sampled=[echo(p) for _ in range(n)], greedy=echo(p)) for p in prompts]

    def update_weights(self, buckets):
        for _ in buckets:
            pass

    def sleep(self):
        pass

    def wake_up(self):
        pass


@pytest.fixture
def toy():
    register_engine("toy", ToyEngine)
    ToyEngine.checked.clear()
    yield
    del ENGINES["toy"]


def test_a_registered_engine_is_configured_checked_and_built(toy, tmp_path):
    from tools.make_tiny_model import make_tiny_model

    from remax_megatron.models import read_hf_config
    from remax_megatron.rollout import SamplingParams

    model = make_tiny_model(str(tmp_path / "m"), "llama", hidden=64, layers=1, heads=4, kv_heads=2, ffn=96)
    cfg = load_config(None, ["reward.functions=[exact_match]", "rollout.engine=toy", "rollout.n=3"])
    arch = read_hf_config(model)
    check_rollout(cfg.rollout, arch, 1)
    assert ToyEngine.checked == [("toy", 1)]
    check_rollout(cfg.rollout, arch, 8, this_machine=False)  # the planner: layout checks only
    assert ToyEngine.checked == [("toy", 1)]
    engine = build_engine(cfg.rollout, hf_dir=model, arch=arch)
    assert isinstance(engine, ToyEngine)
    (rollout,) = engine.generate([[7, 8]], n=3, sampling=SamplingParams(max_new_tokens=1))
    assert [c.token_ids for c in rollout.sampled] == [[7]] * 3 and rollout.greedy.token_ids == [7]
    with pytest.raises(ValueError, match="rollout.n=5: the toy engine samples at most 4"):
        check_rollout(
            load_config(None, ["reward.functions=[exact_match]", "rollout.engine=toy", "rollout.n=5"]).rollout, arch, 1
        )


def test_an_unknown_engine_lists_the_registered_ones(toy):
    cfg = load_config(None, ["reward.functions=[exact_match]", "rollout.engine=tpu"])
    with pytest.raises(ValueError, match="rollout.engine='tpu' is not one of native, vllm, toy"):
        check_rollout(cfg.rollout, None, 1)
