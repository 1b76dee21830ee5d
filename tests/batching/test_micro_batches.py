"""batching/micro_batches.py: token-budget micro-batches, packed rows, the DP balance, the global normalisation.

Pure python (no process group, but for the one all-to-all that moves rows between 3 gloo ranks): the plans,
the row exchange keeping each sample with its prompt's greedy reward, the packed layout and its documents' bounds,
and that summing per-micro-batch losses with GLOBAL counts gives the whole batch's loss whatever the grouping
(with per-micro-batch counts it does not).
The updates themselves are compared in tests/train/test_update.py.
"""

import random

import pytest
import torch
import torch.distributed as dist

from remax_megatron.algo.aggregation import AGG_MODES, aggregate
from tests._dist import run_distributed
from remax_megatron.batching.micro_batches import (
    assemble,
    balance_rows,
    equalize,
    exchange_rows,
    fixed_micro_batches,
    model_inputs,
    model_labels,
    plan_micro_batches,
    plan_step,
    take_rows,
    to_rows,
    to_sequences,
)


def _geometric(n, mean, cap, seed):
    rng = random.Random(seed)
    return [min(cap, 1 + int(rng.expovariate(1 / mean))) for _ in range(n)]


def _batch(lengths, width=None, tag=0):
    """Rows whose tokens, rewards and baselines name their row (tag * 1000 + row), right-padded."""
    width = width or max(lengths)
    b = len(lengths)
    ids = torch.zeros(b, width, dtype=torch.long)
    labels = torch.full((b, width), -100)
    for i, n in enumerate(lengths):
        ids[i, :n] = tag * 1000 + i
        labels[i, 1 : n - 1] = tag * 1000 + i
    return dict(
        input_ids=ids,
        labels=labels,
        response_mask=labels != -100,
        lengths=torch.tensor(lengths),
        rewards=torch.arange(b, dtype=torch.float32) + tag * 1000,
        baseline=(torch.arange(b, dtype=torch.float32) + tag * 1000) // 2 + 0.5,
    )


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("multiple", [1, 2])
def test_micro_batches_respect_the_budget_and_hold_every_row_once(pack, multiple):
    lengths = _geometric(97, 40, 300, seed=pack + 2 * multiple)
    budget = 1024
    micro = plan_micro_batches(lengths, budget, multiple, pack)
    assert sorted(r for m in micro for r in m.rows) == list(range(97))
    for m in micro:
        assert m.width % multiple == 0 and m.width >= max(lengths[r] for r in m.rows)
        if pack:
            assert len(m.bins) * m.row_width <= budget
            assert sorted(j for b in m.bins for j in b) == list(range(len(m.rows)))
            assert all(sum(lengths[m.rows[j]] for j in b) <= m.row_width for b in m.bins)
        else:
            assert len(m.rows) * m.width <= budget
            assert m.width == -(-max(lengths[r] for r in m.rows) // multiple) * multiple  # own longest row


def test_packing_computes_few_padding_tokens():
    """Geometric lengths (mean ~128, as the variable-length benchmark's): packed rows compute <= 1.1x the
    real tokens, padded token-budget micro-batches more, fixed-count ones the most."""
    lengths = _geometric(256, 128, 576, seed=0)
    real = sum(lengths)
    packed = sum(len(m.bins) * m.row_width for m in plan_micro_batches(lengths, 4096, 1, pack=True))
    padded = sum(len(m.rows) * m.width for m in plan_micro_batches(lengths, 4096, 1, pack=False))
    fixed = len(lengths) * max(lengths)
    assert packed / real <= 1.1 < padded / real < fixed / real, (packed / real, padded / real, fixed / real)


def test_a_budget_below_one_row_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^trainer.micro_batch_tokens=10 is smaller than one row of 12 tokens"):
        plan_micro_batches([5, 11], budget=10, multiple=4)


def test_dp_balance_deals_near_equal_tokens_and_every_row_once():
    lengths = [_geometric(16, 60, 400, seed=r) for r in range(4)]
    lengths[3] = [400] * 16  # one rank rolled out long answers
    dealt = balance_rows(lengths)
    assert sorted(x for d in dealt for x in d) == sorted((r, i) for r in range(4) for i in range(16))
    tokens = [sum(lengths[r][i] for r, i in d) for d in dealt]
    assert max(tokens) - min(tokens) <= max(max(x) for x in lengths), tokens
    assert balance_rows(lengths) == dealt  # every rank computes the same


def test_rows_keep_their_reward_and_greedy_baseline_when_they_move_between_ranks():
    lengths = [[3, 9, 4, 7], [12, 2, 2, 5], [6, 6, 11, 3]]
    batches = [_batch(ls, tag=r) for r, ls in enumerate(lengths)]
    plan = plan_step(lengths, mini_batches=2, budget=24, multiple=2, pack=False)
    seen = []
    for rank in range(3):
        mine = take_rows(batches, plan.sources[rank])
        for row, (src, i) in enumerate(plan.sources[rank]):
            n = lengths[src][i]
            assert mine["lengths"][row] == n
            assert (mine["input_ids"][row, :n] == src * 1000 + i).all() and (mine["input_ids"][row, n:] == 0).all()
            assert (mine["labels"][row, n:] == -100).all()
            assert mine["rewards"][row] == src * 1000 + i
            assert mine["baseline"][row] == (src * 1000 + i) // 2 + 0.5  # its own prompt's greedy reward
            seen.append((src, i))
        # every update's micro-batches cover this rank's rows of that update, in the update's order
        rows = [r for update in plan.updates[rank] for m in update for r in m.rows]
        assert sorted(rows) == list(range(len(plan.sources[rank])))
    assert sorted(seen) == sorted((r, i) for r in range(3) for i in range(4))
    for u in range(2):  # the same number of micro-batches on every rank, rows from update u only
        assert len({len(plan.updates[rank][u]) for rank in range(3)}) == 1
        for rank in range(3):
            sources = [plan.sources[rank][r] for m in plan.updates[rank][u] for r in m.rows]
            assert all(2 * u <= i < 2 * (u + 1) for _, i in sources)


def _exchange_body(rank, world, lengths):
    batches = [_batch(ls, tag=r) for r, ls in enumerate(lengths)]
    for b in batches:  # a per-token tensor with a trailing dim (routes: fill -1) and a per-row float
        b["routed_experts"] = torch.stack([b["input_ids"], -b["input_ids"]], dim=-1)
    plan = plan_step(lengths, mini_batches=2, budget=40, multiple=2, pack=True)
    widest = max(b["input_ids"].shape[1] for b in batches)
    got = exchange_rows(batches[rank], plan.sources, rank, widest, dist.group.WORLD)
    want = take_rows(batches, plan.sources[rank])  # what gathering every rank's batch gave
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert {src for src, _ in plan.sources[rank]} == {0, 1, 2}  # rows did move in from every rank


def test_the_all_to_all_moves_each_row_to_the_rank_it_was_dealt_to():
    # three ranks of different widths and row counts; rank 2 rolled out the long answers
    lengths = [[3, 9, 4, 7, 5, 2], [12, 2, 2, 5], [16, 16, 11, 3, 14, 15, 9, 1]]
    run_distributed(_exchange_body, world_size=3, args=(lengths,))


def test_ranks_short_of_micro_batches_split_theirs_then_run_ghosts():
    lengths = {0: 7, 1: 3, 2: 5}
    micro = plan_micro_batches([7, 3, 5], budget=21, multiple=1)
    assert len(micro) == 1
    more = equalize(micro, 4, lengths, multiple=1)
    assert len(more) == 4 and sorted(r for m in more for r in m.rows) == [0, 1, 2]
    assert sum(m.ghost for m in more) == 1
    batch = _batch([7, 3, 5])
    ghost = assemble(batch, next(m for m in more if m.ghost))
    assert ghost["input_ids"].shape == (1, 1) and not ghost["response_mask"].any() and ghost["padding"].all()


def test_packed_rows_hold_the_sequences_and_their_labels():
    lengths = [5, 3, 8, 2, 6]
    batch = _batch(lengths, width=8)
    (micro,) = plan_micro_batches(lengths, budget=32, multiple=1, pack=True)
    mb = assemble(batch, micro)
    rows, width = mb["input_ids"].shape
    assert micro.row_width == 8 and len(micro.bins) * 8 <= 32  # the budget's rows
    assert (rows, width) == (1, sum(lengths))  # the model's: every sequence back to back in one row
    for j, r in enumerate(micro.rows):
        n = lengths[r]
        flat = mb["unpack"][j, :n]
        assert (mb["input_ids"].reshape(-1)[flat] == batch["input_ids"][r, :n]).all()
        assert (model_labels(mb).reshape(-1)[flat] == batch["labels"][r, :n]).all()
    assert model_labels(mb).ne(-100).sum() == batch["response_mask"].sum()
    assert mb["padding"].sum() == rows * width - sum(lengths)
    values = torch.randn(len(lengths), 8) * mb["response_mask"]
    assert torch.equal(to_sequences(mb, to_rows(mb, values)), values)  # round trip on every labelled token
    _, kwargs = model_inputs(mb)
    assert kwargs["attention_mask"] is None and kwargs["packed_seq_params"].qkv_format == "thd"


def test_thd_rows_carry_cu_seqlens():
    lengths = [5, 3, 8]
    batch = _batch(lengths, width=8)
    (micro,) = plan_micro_batches(lengths, budget=32, multiple=4, pack=True)
    mb = assemble(batch, micro, multiple=4)
    assert mb["input_ids"].shape == (1, 16)  # 16 real tokens, already a multiple of 4
    order = [micro.rows[j] for b in micro.bins for j in b]
    assert mb["cu_seqlens"].tolist() == [0] + list(torch.tensor([lengths[r] for r in order]).cumsum(0).tolist())
    assert int(mb["max_seqlen"]) == 8
    (micro,) = plan_micro_batches([5, 2], budget=32, multiple=4, pack=True)
    mb = assemble(_batch([5, 2], width=8), micro, multiple=4)
    assert mb["input_ids"].shape == (1, 8) and mb["cu_seqlens"].tolist() == [0, 5, 7, 8]  # padding: its own


def test_fixed_micro_batches_are_todays():
    micro = fixed_micro_batches(list(range(8, 16)), 3, width=12)
    assert [m.rows for m in micro] == [[8, 9, 10], [11, 12, 13], [14, 15]] and {m.width for m in micro} == {12}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("pack", [False, True])
def test_global_counts_make_the_loss_independent_of_the_grouping(mode, pack):
    """Summing per-micro-batch aggregates normalised by the update's global counts gives the whole batch's
    aggregate for any token-budget grouping; normalising each micro-batch by its own counts does not."""
    lengths = _geometric(40, 20, 60, seed=3)
    g = torch.Generator().manual_seed(0)
    batch = _batch(lengths)
    values = torch.randn(batch["input_ids"].shape, generator=g, dtype=torch.float64)
    mask = batch["response_mask"]
    whole = aggregate(values, mask, mode)
    counts = dict(global_num_tokens=mask.sum().item(), global_num_seqs=len(lengths))
    micro = plan_micro_batches(lengths, 150, 1, pack)
    assert len(micro) > 3
    parts, local = 0.0, 0.0
    for m in micro:
        mb = assemble(dict(batch, values=values), m)
        parts += aggregate(mb["values"], mb["response_mask"], mode, **counts)
        local += aggregate(mb["values"], mb["response_mask"], mode) / len(micro)
    assert abs(parts - whole) < 1e-12
    assert abs(local - whole) > 1e-3  # per-micro-batch normalisation depends on the grouping


def test_packing_where_the_attention_cannot_keep_sequences_apart_is_refused(monkeypatch):
    """Under Transformer Engine packed rows run in its THD attention, which float32 does not reach (its flash
    and cuDNN backends take bf16 / fp16); the local spec's (models/attention.py, LoRA too) runs any dtype."""
    import remax_megatron.models.arch as arch

    monkeypatch.setattr(arch, "transformer_engine_usable", lambda: True)
    with pytest.raises(ValueError, match=r"^trainer.pack_sequences=true with actor.dtype=float32 under Transformer"):
        arch.check_packing(torch.float32)
    arch.check_packing(torch.bfloat16)
    arch.check_packing(torch.float32, local_spec=True)
    monkeypatch.setattr(arch, "transformer_engine_usable", lambda: False)
    arch.check_packing(torch.float32)
