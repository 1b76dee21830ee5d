"""rollout.placement=separate's plumbing (parallel/split.py, rollout/remote.py) with a stub engine whose
completions name the weights it held: gloo, 2 training ranks + 1 or 2 rollout ranks.

- each training rank gets the rollouts of its own prompts, in order, with its own seeds
- a request in flight is generated with the weights it was submitted under, even when the next sync is
  sent before it is collected (the bridge settles it first); the next request sees the new weights
- the weights arrive bitwise on every rollout rank (several buckets, two dtypes of tensors' shapes)
- a stop ends the rollout ranks' loop; each side had its own default group (world 2 | K)
"""

import os
import pickle
import traceback

import pytest
import torch

from tests._dist import _context, _free_port

PROMPTS = {0: [[5, 6, 7], [8, 9]], 1: [[10], [11, 12, 13], [14, 15]]}  # training rank -> its prompts


def _weights(version: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(version)
    return [
        [("a", torch.randn(3, 4, generator=g)), ("b", torch.randn(5, generator=g))],
        [("c", torch.randn(2, 2, 2, generator=g))],
    ]


def _stub_engine():
    from remax_megatron.rollout.engine import Completion, PromptRollout, RolloutEngine

    class Stub(RolloutEngine):
        """Completions: the prompt reversed, then the seed; log-prob = the sum of weight "a" (which version)."""

        name = "stub"

        def __init__(self):
            super().__init__(0)
            self.weights = {}

        def update_weights(self, buckets):
            for bucket in buckets:
                for name, tensor in bucket:
                    self.weights[name] = tensor.clone()

        def _generate(self, prompts, n, sampling, seeds):
            mark = float(self.weights["a"].sum())
            out = []
            for p, s in zip(prompts, seeds):
                c = Completion(token_ids=p[::-1] + [s], logprobs=[mark] * (len(p) + 1), finish_reason="stop")
                out.append(PromptRollout(sampled=[c] * n, greedy=c))
                self.decoded_tokens += len(c.token_ids) * (n + 1)
            return out

        def sleep(self):
            pass

        def wake_up(self):
            pass

    return Stub()


def _body(rank, world, rollout_ranks, port, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        import torch.distributed as dist

        from remax_megatron.parallel.split import split_world
        from remax_megatron.rollout import SamplingParams
        from remax_megatron.rollout.remote import RemoteEngine, serve

        split = split_world(rollout_ranks)
        side = (dist.get_rank(), dist.get_world_size())
        if split.role == "rollout":
            engine = _stub_engine()
            served = serve(engine, split.bridge)
            # plain pickle: the queue's own would pass the tensors as shared memory of an exited process
            results.put((rank, "rollout", pickle.dumps({"served": served, "side": side, "weights": engine.weights})))
            return
        engine = RemoteEngine(split.bridge, dtype=torch.float32)
        mine = PROMPTS[rank]
        seeds = [100 * rank + i for i in range(len(mine))]
        sampling = SamplingParams(max_new_tokens=4)
        engine.update_weights(iter(_weights(0)))
        first = engine.submit(mine, 2, sampling, seeds)  # in flight while the "update" runs
        engine.update_weights(iter(_weights(1)))  # settles `first` before sending
        second = engine.submit(mine, 1, sampling, seeds)
        got_first, got_second = engine.collect(first), engine.collect(second)
        engine.shutdown()
        results.put(
            (
                rank,
                "train",
                pickle.dumps(
                    {"first": got_first, "second": got_second, "side": side, "decoded": engine.decoded_tokens}
                ),
            )
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


@pytest.mark.slow
@pytest.mark.parametrize("rollout_ranks", [1, 2])
def test_requests_and_weights_cross_the_bridge_in_order(rollout_ranks):
    world = 2 + rollout_ranks
    ctx = _context()
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_body, args=(r, world, rollout_ranks, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    got = {}
    while not results.empty():
        rank, role, value = results.get()
        assert role != "error", f"rank {rank}:\n{value}"
        got[rank] = (role, pickle.loads(value))
    assert sorted(got) == list(range(world)) and all(p.exitcode == 0 for p in procs)
    marks = [float(_weights(v)[0][0][1].sum()) for v in (0, 1)]
    decoded = 0
    for rank in (0, 1):
        role, r = got[rank]
        assert role == "train" and r["side"] == (rank, 2)
        for which, n, mark in (("first", 2, marks[0]), ("second", 1, marks[1])):
            rollouts = r[which]
            assert len(rollouts) == len(PROMPTS[rank])
            for i, (prompt, rollout) in enumerate(zip(PROMPTS[rank], rollouts)):
                assert rollout.greedy.token_ids == prompt[::-1] + [100 * rank + i]  # its own prompt and seed
                assert len(rollout.sampled) == n
                assert rollout.greedy.logprobs[0] == pytest.approx(mark, rel=1e-6), (rank, which)
        decoded += r["decoded"]
    total = sum(len(p) + 1 for ps in PROMPTS.values() for p in ps)
    assert decoded == total * 3 + total * 2  # n=2 (+greedy), then n=1 (+greedy), counted on training rank 0
    for rank in range(2, world):
        role, r = got[rank]
        assert role == "rollout" and r["side"] == (rank - 2, rollout_ranks) and r["served"] == 2
        sent = {name: t for bucket in _weights(1) for name, t in bucket}
        assert set(r["weights"]) == set(sent)
        for name, t in sent.items():
            assert torch.equal(r["weights"][name], t), name
