"""rollout/dynamic_sampling.py: prompts whose samples all tie their greedy reward leave the step, more are
drawn until it holds trainer.prompts_per_step prompts with signal (or the rounds run out); every sample keeps
its own prompt's greedy reward; over DP the kept prompts are dealt in draw order."""

import os
from types import SimpleNamespace

import pytest
import torch

from remax_megatron.rollout.dynamic_sampling import DynamicSampling, Scored, has_signal

N = 2


def _cfg(want=4, rounds=4):
    return SimpleNamespace(
        rollout=SimpleNamespace(n=N),
        trainer=SimpleNamespace(prompts_per_step=want),
        algo=SimpleNamespace(dynamic_sampling_max_rounds=rounds),
    )


def _round(ids, tied):
    """Prompts `ids` (ints stand in for prompts and rollouts); those in `tied` have both samples equal to
    their greedy reward, the others one sample above it. The greedy reward is the prompt's id (unique)."""
    r_sampled, r_greedy = [], []
    for i in ids:
        r_greedy.append(float(i))
        r_sampled += [float(i), float(i) if i in tied else i + 1.0]
    return Scored(list(ids), [f"rollout-{i}" for i in ids], r_sampled, r_greedy)


class _OneRank:
    groups = SimpleNamespace(dp_size=1, dp_rank=0)

    @staticmethod
    def global_sum(value):
        return value


def test_has_signal_is_any_sample_off_the_greedy_reward():
    assert has_signal([0.0, 1.0], 0.0) and not has_signal([1.0, 1.0], 1.0)


def test_tied_prompts_are_replaced_by_drawn_ones_in_draw_order():
    rounds = {1: _round([4, 5, 6, 7], tied={5, 7}), 2: _round([8, 9, 10, 11], tied=set())}
    drawn = []
    sampling = DynamicSampling(_cfg(), _OneRank.groups, _OneRank)
    scored, metrics = sampling.fill(_round([0, 1, 2, 3], tied={1, 3}), lambda r: drawn.append(r) or rounds[r])
    assert drawn == [1] and scored.prompts == [0, 2, 4, 6]
    assert scored.rollouts == [f"rollout-{i}" for i in scored.prompts]
    # each sample keeps its own prompt's greedy reward, and the rewards stay in prompt order
    assert scored.r_greedy == [0.0, 2.0, 4.0, 6.0]
    assert scored.r_sampled == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert all(has_signal(scored.r_sampled[i * N : (i + 1) * N], g) for i, g in enumerate(scored.r_greedy))
    assert metrics == {
        "sampling/rounds": 2,
        "sampling/prompts_drawn": 8,
        "sampling/dropped_prompts": 4,
        "sampling/unused_prompts": 0,
        "sampling/short_prompts": 0,
    }


def test_no_round_more_when_the_first_batch_has_signal():
    sampling = DynamicSampling(_cfg(), _OneRank.groups, _OneRank)
    scored, metrics = sampling.fill(_round([0, 1, 2, 3], tied=set()), lambda r: pytest.fail("drew more"))
    assert scored.prompts == [0, 1, 2, 3] and metrics["sampling/rounds"] == 1


def test_rounds_run_out_then_the_step_is_topped_up_with_the_first_dropped_prompts():
    sampling = DynamicSampling(_cfg(rounds=2), _OneRank.groups, _OneRank)
    scored, metrics = sampling.fill(_round([0, 1, 2, 3], tied={0, 1, 3}), lambda r: _round([4, 5, 6, 7], {4, 5, 6}))
    assert scored.prompts == [2, 7, 0, 1] and len(scored.r_sampled) == 4 * N
    assert metrics["sampling/short_prompts"] == 2 and metrics["sampling/dropped_prompts"] == 4
    assert metrics["sampling/rounds"] == 2


def _dp_body(rank, world, out_dir):
    import torch.distributed as dist

    from remax_megatron.step_metrics import DpReduce

    groups = SimpleNamespace(dp_size=world, dp_rank=rank, dp=dist.group.WORLD)
    sampling = DynamicSampling(_cfg(want=4), groups, DpReduce(groups))
    # global round 0: prompts 0-3 (rank 0 holds 0, 1; rank 1 holds 2, 3); 0, 1 and 2 tie
    first = _round([0, 1] if rank == 0 else [2, 3], tied={0, 1, 2})
    more = {1: _round([4, 5] if rank == 0 else [6, 7], tied={5}), 2: _round([8, 9] if rank == 0 else [10, 11], set())}
    scored, metrics = sampling.fill(first, lambda r: more[r])
    torch.save(
        {"prompts": scored.prompts, "greedy": scored.r_greedy, "metrics": metrics}, os.path.join(out_dir, f"{rank}.pt")
    )


@pytest.mark.slow
def test_over_dp_the_kept_prompts_are_dealt_in_draw_order(tmp_path):
    from tests._dist import run_distributed

    run_distributed(_dp_body, world_size=2, args=(str(tmp_path),))
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    # kept in draw order (round, rank, place): 3, then round 1: 4, 6, 7 -> rank 0 gets [3, 4], rank 1 [6, 7]
    assert ranks[0]["prompts"] == [3, 4] and ranks[1]["prompts"] == [6, 7]
    assert ranks[0]["greedy"] == [3.0, 4.0] and ranks[1]["greedy"] == [6.0, 7.0]
    assert ranks[0]["metrics"] == ranks[1]["metrics"] and ranks[0]["metrics"]["sampling/rounds"] == 2
