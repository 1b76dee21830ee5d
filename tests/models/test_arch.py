"""The expert rules' owner (models/arch.expert_options) and the layout rules' owners (models/hf_config.
check_layout / check_tp_heads, parallel/layout.check_rollout_tp): fast, no model built."""

from types import SimpleNamespace

import pytest

from remax_megatron.config import load_config
from remax_megatron.models.arch import ExpertOptions, expert_options

BASE = ["reward.functions=[exact_match]"]
DENSE = SimpleNamespace(is_moe=False, architecture="LlamaForCausalLM")
MOE = SimpleNamespace(is_moe=True, architecture="MixtralForCausalLM", num_experts=4)


def test_dense_models_get_the_default_options_and_refuse_replay():
    assert expert_options(load_config(None, BASE), DENSE) == ExpertOptions()
    with pytest.raises(ValueError, match="has no experts to route: set it to false"):
        expert_options(load_config(None, [*BASE, "rollout.routing_replay=true"]), DENSE)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.tp=2"], "actor.tp=2 with a mixture-of-experts model needs actor.sequence_parallel=true"),
        (
            ["actor.moe_dispatcher=allgather", "trainer.micro_batch_tokens=4096"],
            "which its allgather dispatcher refuses",
        ),
        (
            [
                "trainer.micro_batch_tokens=4096",
                "trainer.pack_sequences=true",
                "algo.moe_aux_loss=seq_aux",
                "actor.recompute=full",
            ],
            "would not know which packed sequence",
        ),
    ],
)
def test_expert_refusals_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        expert_options(load_config(None, [*BASE, *overrides]), MOE)


def test_expert_options_follow_the_config(monkeypatch):
    from remax_megatron.models import arch

    monkeypatch.setattr(arch, "transformer_engine_usable", lambda: False)
    cfg = load_config(None, [*BASE, "actor.ep=2", "actor.tp=2", "actor.sequence_parallel=true", "actor.etp=1"])
    assert expert_options(cfg, MOE) == ExpertOptions(ep=2, etp=1, dispatcher="alltoall", grouped_gemm=False)
    cfg = load_config(None, [*BASE, "actor.moe_experts=grouped"])
    with pytest.raises(ValueError, match="actor.moe_experts=grouped needs CUDA and Transformer Engine"):
        expert_options(cfg, MOE)
    # Planning a GPU job on another machine: what this one lacks is not a refusal there.
    assert expert_options(cfg, MOE, this_machine=False).grouped_gemm is True


def test_tp_splits_whole_heads_for_the_actor_and_the_rollout():
    from remax_megatron.models.hf_config import check_layout, check_tp_heads

    arch = SimpleNamespace(num_heads=4, num_kv_heads=2, num_layers=2, is_moe=False, architecture="LlamaForCausalLM")
    check_tp_heads(arch, 2, "rollout.tp")
    with pytest.raises(ValueError, match=r"^rollout.tp=4 does not divide num_key_value_heads=2: choose rollout.tp "):
        check_tp_heads(arch, 4, "rollout.tp")
    with pytest.raises(ValueError, match=r"^actor.tp=3 does not divide num_attention_heads=4"):
        check_layout(arch, 3, 1, "actor")
    with pytest.raises(ValueError, match=r"^--tp=3 does not divide num_attention_heads=4: choose tp from"):
        check_layout(arch, 3, 1, "--")


def test_rollout_tp_divides_the_engine_ranks():
    from remax_megatron.parallel.layout import check_rollout_tp

    check_rollout_tp(2, 4)
    with pytest.raises(ValueError, match=r"^rollout.tp=3 does not divide the world size 4: choose rollout.tp"):
        check_rollout_tp(3, 4)
    with pytest.raises(ValueError, match=r"^rollout.tp\(2\) does not divide rollout.ranks\(3\)"):
        check_rollout_tp(2, 3, separate=True)
