"""The native engine's batched sampler (rollout/sampling.py): a row's draw depends on its seed and position
only, draws follow softmax(logits / T) (also under top-k / top-p), greedy rows take argmax, neighbouring
keys draw independently; a sampler keyed by the row's place in the batch fails these tests."""

import pytest
import torch

from remax_megatron.rollout import sampling
from remax_megatron.rollout.sampling import filter_logits, mix64, row_keys, sample_tokens
from tests.rollout.helpers import assert_chi_square

VOCAB = 37


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def _draw(logits, seeds, positions, temperature=1.0, greedy=None, top_k=0, top_p=1.0):
    """tokens, logprobs of rows (logits [B, V], seeds [B], positions [B]); one call = one batch."""
    b = logits.shape[0]
    greedy = torch.zeros(b, dtype=torch.bool) if greedy is None else torch.as_tensor(greedy)
    temp = torch.where(greedy, 1.0, temperature).to(torch.float32)
    return sample_tokens(
        logits, temp, greedy, sampling.row_keys(seeds), torch.as_tensor(positions, dtype=torch.int64), top_k, top_p
    )


def test_mix64_is_splitmix64_on_uint64():
    """The int64 ops (wrapping products, logical shifts) give splitmix64's finaliser bit for bit."""

    def reference(z: int) -> int:
        m = (1 << 64) - 1
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    values = [0, 1, 2, 12345, 2**31 - 1, 2**62 + 7, -1, -(2**63), 2**63 - 1, -987654321]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [reference(v & ((1 << 64) - 1)) for v in values]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7)])
def test_a_rows_draw_does_not_depend_on_the_batch(top_k, top_p):
    """Same seed and position -> same token: alone (P = 1) or among 16, rows reversed, other prompts
    added, greedy rows mixed in."""
    logits = _logits(16)
    seeds = torch.randint(0, 2**30, (16,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16) * 3 % 7
    kw = dict(temperature=0.9, top_k=top_k, top_p=top_p)
    full, full_lp = _draw(logits, seeds, positions, **kw)
    assert len(set(full.tolist())) > 4, "the rows drew too few distinct tokens to show anything"
    alone = torch.cat([_draw(logits[i : i + 1], seeds[i : i + 1], positions[i : i + 1], **kw)[0] for i in range(16)])
    assert torch.equal(alone, full)
    order = torch.arange(15, -1, -1)
    assert torch.equal(_draw(logits[order], seeds[order], positions[order], **kw)[0], full[order])
    others = _logits(5, seed=9)
    more = _draw(
        torch.cat([others, logits]), torch.cat([seeds[:5] + 1000, seeds]), torch.cat([positions[:5], positions]), **kw
    )[0]
    assert torch.equal(more[5:], full)
    greedy = torch.arange(16) % 3 == 0
    mixed, mixed_lp = _draw(logits, seeds, positions, greedy=greedy, **kw)
    assert torch.equal(mixed[~greedy], full[~greedy])
    assert torch.allclose(mixed_lp[~greedy], full_lp[~greedy])


def test_greedy_rows_take_argmax_at_temperature_one():
    logits = _logits(8, seed=3)
    greedy = torch.tensor([True, False] * 4)
    tokens, logprobs = _draw(logits, torch.arange(8), torch.zeros(8), temperature=0.5, greedy=greedy, top_k=2)
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    want = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs[greedy], want[greedy])
    every, temp, keys, zero = torch.ones(8, dtype=torch.bool), torch.ones(8), row_keys(range(8)), torch.zeros(8).long()
    fast = sample_tokens(logits, temp, every, keys, zero, all_greedy=True)  # an eval request: no noise made
    slow = sample_tokens(logits, temp, every, keys, zero)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_logprobs_are_before_truncation():
    """rollout/engine.py's convention: log softmax(logits / T)[token], before top-k / top-p."""
    logits = _logits(64, seed=4)
    tokens, logprobs = _draw(logits, torch.arange(64), torch.zeros(64), temperature=0.7, top_k=3, top_p=0.8)
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, want)


DRAWS = 20_000


def _counts(tokens: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab)


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_draws_follow_the_tempered_softmax(over):
    """20,000 draws of one row's logits (over 30-bit seeds as stream_seed makes them, or over one seed's
    positions) vs softmax(logits / T), chi-square at 1%. (2,000,000 draws each: p = 0.97 and 0.88.)"""
    logits = _logits(1, seed=5).expand(DRAWS, -1)
    if over == "seeds":
        seeds, positions = torch.randint(0, 2**30, (DRAWS,), generator=torch.Generator().manual_seed(11)), 0
    else:
        seeds, positions = 77, torch.arange(DRAWS)
    seeds, positions = torch.as_tensor(seeds).expand(DRAWS), torch.as_tensor(positions).expand(DRAWS)
    tokens, _ = _draw(logits, seeds, positions, temperature=0.8)
    assert_chi_square(_counts(tokens), torch.softmax(logits[0] / 0.8, -1), level=1e-2)


def test_top_k_draws_follow_the_renormalised_top_k():
    logits = _logits(1, seed=6).expand(DRAWS, -1)
    tokens, _ = _draw(logits, torch.arange(DRAWS), torch.full((DRAWS,), 3), temperature=1.2, top_k=5)
    scaled = logits[0] / 1.2
    allowed = torch.topk(scaled, 5).indices
    counts = _counts(tokens)
    outside = counts.clone()
    outside[allowed] = 0
    assert outside.sum() == 0, f"drew tokens outside the top-5: {outside.nonzero().flatten().tolist()}"
    probs = torch.zeros_like(scaled)
    probs[allowed] = torch.softmax(scaled[allowed], -1)
    assert_chi_square(counts, probs, level=1e-2)


def test_top_p_draws_follow_the_renormalised_nucleus():
    logits = _logits(1, seed=7).expand(DRAWS, -1)
    tokens, _ = _draw(logits, torch.arange(DRAWS) + 50_000, torch.zeros(DRAWS), top_p=0.75)
    probs = torch.softmax(logits[0], -1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = order[(sorted_p.cumsum(0) - sorted_p) < 0.75]
    assert 2 < len(keep) < VOCAB, "the test distribution must make top-p cut"
    counts = _counts(tokens)
    outside = counts.clone()
    outside[keep] = 0
    assert outside.sum() == 0, f"drew tokens outside the nucleus: {outside.nonzero().flatten().tolist()}"
    nucleus = torch.zeros_like(probs)
    nucleus[keep] = probs[keep] / probs[keep].sum()
    assert_chi_square(counts, nucleus, level=1e-2)


# ---- independence of neighbouring keys --------------------------------------------------------------------
PAIR_VOCAB = 6  # 36 cells of token pairs, ~550 pairs each


def _pair_failures() -> list[str]:
    """Joint chi-square (1%) over token pairs of neighbouring keys: (s, t) with (s + 1, t), (s, t + 1),
    (s + 1, t + 1), and (s + 1, t) with (s, t + 1). Each key's draws come from its own batch call, the rows in
    the same order (row i: base seed s_i, position t_i). Returns the pairs that fail."""
    logits = _logits(1, seed=8, vocab=PAIR_VOCAB).expand(DRAWS, -1) * 0.5
    gen = torch.Generator().manual_seed(10)
    s = torch.randint(0, 2**30, (DRAWS,), generator=gen)
    t = torch.randint(0, 200, (DRAWS,), generator=gen)
    probs = torch.softmax(logits[0], -1)
    draw = {
        (ds, dt): _draw(logits, s + ds, t + dt)[0]  # ds, dt: offsets of the seed and the position
        for ds, dt in [(0, 0), (1, 0), (0, 1), (1, 1)]
    }
    failures = []
    for a, b in [((0, 0), (1, 0)), ((0, 0), (0, 1)), ((0, 0), (1, 1)), ((1, 0), (0, 1))]:
        joint = torch.bincount(draw[a] * PAIR_VOCAB + draw[b], minlength=PAIR_VOCAB**2)
        try:
            assert_chi_square(joint, torch.outer(probs, probs).flatten(), level=1e-2)
        except AssertionError as error:
            failures.append(f"{a} vs {b}: {error}")
    return failures


def test_neighbouring_keys_draw_independently():
    assert _pair_failures() == []


def _place_keyed(original):
    """The broken keying: the row's place in the batch instead of its seed."""
    return lambda keys, positions, vocab: original(row_keys(torch.arange(len(keys))), positions, vocab)


def _sum_keyed(original):
    """The broken keying: one counter seed + position (so (s + 1, t) is (s, t + 1))."""
    return lambda keys, positions, vocab: original(row_keys(keys + positions), torch.zeros_like(positions), vocab)


def test_place_keying_fails_the_independence_and_batch_tests(monkeypatch):
    """Break the keying on purpose: the tests above must catch it."""
    monkeypatch.setattr(sampling, "gumbel_noise", _place_keyed(sampling.gumbel_noise))
    failures = _pair_failures()
    assert failures and failures[0].startswith("(0, 0) vs (1, 0)"), failures  # the same place: the same draw
    with pytest.raises(AssertionError):
        test_a_rows_draw_does_not_depend_on_the_batch(0, 1.0)


def test_seed_plus_position_keying_fails_the_independence_test(monkeypatch):
    monkeypatch.setattr(sampling, "row_keys", lambda seeds: torch.as_tensor(seeds, dtype=torch.int64))
    monkeypatch.setattr(sampling, "gumbel_noise", _sum_keyed(sampling.gumbel_noise))
    failures = _pair_failures()
    assert len(failures) == 1 and failures[0].startswith("(1, 0) vs (0, 1)"), failures


def test_filter_logits_keeps_the_top_token_and_ties():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).sum(-1).tolist() == [3, 4]
    assert torch.isfinite(filter_logits(logits, 0, 1e-6)).sum(-1).tolist() == [1, 1]
