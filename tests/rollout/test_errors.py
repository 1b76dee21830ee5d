"""Bad input to the rollout: one-line ValueErrors that name the value."""

import pytest

from remax_megatron.config import RolloutConfig, load_config
from remax_megatron.models import read_hf_config
from remax_megatron.rollout import SamplingParams, build_engine, check_rollout_layout

REWARD = "reward.functions=[exact_match]"


@pytest.mark.parametrize("override,message", [
    ("rollout.n=0", "rollout.n=0"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0"),
    ("rollout.sync_bucket_mb=0", "rollout.sync_bucket_mb=0"),
    ("rollout.sync_bucket_mb=-5", "rollout.sync_bucket_mb=-5"),
    ("rollout.engine=sglang", "rollout.engine='sglang'"),
    ("rollout.tp=0", "rollout.tp=0"),
])
def test_config_refuses(override, message):
    with pytest.raises(ValueError, match=message.replace("[", "\\[")) as info:
        load_config(None, [REWARD, override])
    assert "\n" not in str(info.value)


def test_world_check_names_rollout_tp():
    cfg = load_config(None, [REWARD, "rollout.engine=vllm", "rollout.tp=3"])
    with pytest.raises(ValueError, match="rollout.tp=3 does not divide the world size 4"):
        cfg.check_world(4)


def test_layout_checks(tiny_llama):
    arch = read_hf_config(tiny_llama)   # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="rollout.tp=3 does not divide the world size 4"):
        check_rollout_layout(RolloutConfig(engine="vllm", tp=3), arch, 4)
    with pytest.raises(ValueError, match="rollout.tp=4 does not divide num_key_value_heads=2"):
        check_rollout_layout(RolloutConfig(engine="vllm", tp=4), arch, 4)
    with pytest.raises(ValueError, match="rollout.tp=2 needs rollout.engine=vllm"):
        check_rollout_layout(RolloutConfig(engine="native", tp=2), arch, 2)
    check_rollout_layout(RolloutConfig(engine="vllm", tp=2), arch, 4)


def test_build_engine_checks_before_importing_vllm(tiny_llama):
    # World of 1 (no torch.distributed): tp=2 cannot fit, refused before vLLM is needed.
    with pytest.raises(ValueError, match="rollout.tp=2 does not divide the world size 1"):
        build_engine(RolloutConfig(engine="vllm", tp=2), hf_dir=tiny_llama)
    bad = RolloutConfig()
    bad.engine = "sglang"   # past __post_init__, as a hand-built object could be
    with pytest.raises(ValueError, match="rollout.engine='sglang' is not one of native, vllm"):
        build_engine(bad, hf_dir=tiny_llama)


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=0.0), "temperature=0.0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(stop=[""]), "stop=\\[''\\]"),
])
def test_sampling_params_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_refuses_bad_n_and_empty_prompts(tiny_llama):
    engine = build_engine(RolloutConfig(), hf_dir=tiny_llama)
    with pytest.raises(ValueError, match="n=-1 sampled responses"):
        engine.generate([[1, 2]], n=-1, sampling=SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        engine.generate([[1, 2], []], n=1, sampling=SamplingParams())
