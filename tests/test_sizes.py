"""The integer size rules (remax_megatron/sizes.py): each formula's one owner, called by the config
checks, the planner and the runtime."""

import pytest

from remax_megatron.sizes import ceil_div, check_token_budget, round_up, sequence_multiple


def test_round_up_and_ceil_div():
    assert [round_up(v, 4) for v in (1, 4, 5, 8)] == [4, 4, 8, 8] and round_up(7, 1) == 7
    assert [ceil_div(v, 4) for v in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert ceil_div(10**20 + 1, 10**20) == 2  # exact where a float ceil would not be


def test_sequence_multiple_is_tp_under_sequence_parallel_only():
    assert sequence_multiple(4, True) == 4
    assert sequence_multiple(4, False) == 1
    assert sequence_multiple(1, True) == 1


def test_token_budget_holds_one_row():
    check_token_budget(16, 16)
    with pytest.raises(
        ValueError,
        match=r"^trainer.micro_batch_tokens=15 is smaller than one row of 16 tokens: "
        r"raise it to at least 16$",
    ):
        check_token_budget(15, 16)


def test_callers_use_the_owner():
    """The config check, the padded vocab and the model's multiple go through the same functions."""
    from types import SimpleNamespace

    from remax_megatron.config import load_config
    from remax_megatron.models.hf_config import padded_vocab_size

    assert padded_vocab_size(1000, 2, 128) == round_up(1000, 256)
    cfg = load_config(
        None,
        [
            "reward.functions=[exact_match]",
            "actor.tp=2",
            "actor.sequence_parallel=true",
            "data.max_prompt_tokens=16",
            "rollout.max_new_tokens=3",
            "trainer.micro_batch_tokens=20",
        ],
    )
    assert cfg.longest_sequence() == (19, "data.max_prompt_tokens(16) + rollout.max_new_tokens(3)")
    with pytest.raises(ValueError, match=r"rounded up to a multiple of tp=2 = 20: raise it to at least 20$"):
        load_config(
            None,
            [
                "reward.functions=[exact_match]",
                "actor.tp=2",
                "actor.sequence_parallel=true",
                "data.max_prompt_tokens=16",
                "rollout.max_new_tokens=3",
                "trainer.micro_batch_tokens=19",
            ],
        )
    gpt = pytest.importorskip("remax_megatron.models.gpt")
    model = SimpleNamespace(config=SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True))
    assert gpt.sequence_multiple(model) == sequence_multiple(2, True)
