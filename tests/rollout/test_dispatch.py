"""rollout/dispatch.py: a replica's prompts split over its model-parallel ranks, each prompt's seed fixed by its
place in the step's global batch, and the engine's decoded tokens counted once per collect."""

from types import SimpleNamespace

from remax_megatron.config import RolloutConfig
from remax_megatron.rollout import stream_seed
from remax_megatron.rollout.dispatch import RolloutDispatch, contiguous_share


class _Engine:
    """Records what it was asked; 'decodes' 3 tokens per prompt at submit, as a local engine does."""

    def __init__(self):
        self.asked, self.decoded_tokens, self.slept = [], 0, 0

    def submit(self, token_ids, n, sampling, seeds):
        self.asked.append((token_ids, n, seeds))
        self.decoded_tokens += 3 * len(token_ids)
        return [f"rollout of {ids}" for ids in token_ids]

    def collect(self, ticket):
        return ticket

    def sleep(self):
        self.slept += 1


def _groups(dp_rank=0, dp_size=1):
    return SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, mp_size=1, mp_rank=0, mp=None)


def test_contiguous_shares_cover_every_item_once_and_differ_by_one_at_most():
    for count in range(0, 12):
        for parts in range(1, 5):
            shares = [contiguous_share(count, parts, i) for i in range(parts)]
            assert [i for lo, hi in shares for i in range(lo, hi)] == list(range(count))
            assert max(hi - lo for lo, hi in shares) - min(hi - lo for lo, hi in shares) <= 1


def test_each_prompt_samples_from_its_place_in_the_global_batch():
    prompts = [SimpleNamespace(token_ids=[i, i]) for i in range(8)]
    seeds = {}
    for dp_rank in range(2):
        engine = _Engine()
        dispatch = RolloutDispatch(engine, _groups(dp_rank, 2), RolloutConfig(), seed=11)
        mine = dispatch.share(prompts)
        assert mine == prompts[4 * dp_rank : 4 * dp_rank + 4]
        rollouts = dispatch.generate(mine, n=2, step=5)
        ((asked, n, given),) = engine.asked
        assert n == 2 and asked == [q.token_ids for q in mine] and rollouts == [f"rollout of {a}" for a in asked]
        seeds.update(zip((a[0] for a in asked), given))
        assert dispatch.decoded_tokens == 12 and engine.slept == 1
    assert seeds == {i: stream_seed(11, 5, i) for i in range(8)}  # the same seeds as one DP rank would give


def test_decoded_tokens_count_what_the_engine_decoded_since_the_last_collect():
    engine = _Engine()
    dispatch = RolloutDispatch(engine, _groups(), RolloutConfig(), seed=0)
    dispatch.generate([SimpleNamespace(token_ids=[1])] * 2, n=1, step=0)
    dispatch.generate([SimpleNamespace(token_ids=[1])] * 5, n=1, step=1)
    assert dispatch.decoded_tokens == 15
