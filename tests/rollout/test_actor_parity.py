"""Native engine vs the Megatron actor at TP=2, PP=2 (4 gloo processes), after a bucketed sync.

- fixed sequences: engine log-probs == actor token_logprobs (fp32, 1e-5);
- generated rows: the sampled rows' engine log-probs == the actor's at the sampling
  temperature, the greedy rows' == the actor's at temperature 1 (the monitor reads ~0);
- greedy responses == step-by-step argmax decoding by the actor itself (full_logits).
The engine is built with uninitialised weights, so any agreement comes from the sync.
"""

import pytest
import torch

from tests._dist import SharedLaunches
from tools.make_tiny_model import make_tiny_model

TEMPERATURE = 0.7
MAX_NEW = 8


def _actor_logprobs(actor, batch, temperature):
    """Actor token log-probs [B, S] of a packed batch, on every rank."""
    from remax_megatron.models.forward import broadcast_from_last_stage, forward_only

    out = forward_only(
        actor,
        [{"input_ids": batch["input_ids"], "labels": batch["labels"]}],
        lambda m, hidden, mb: m.token_logprobs(hidden, mb["labels"], temperature=temperature)[0],
    )
    return broadcast_from_last_stage(out[0] if out else None, batch["input_ids"].shape, torch.float32)


def _actor_greedy(actor, prompts, eos_ids, pad_id, multiple=1):
    """Greedy decoding by the actor: the whole prefix re-run each step, argmax of full_logits (rows
    right-padded to a multiple of `multiple`: sequence parallel's TP)."""
    from remax_megatron.models.forward import broadcast_from_last_stage, forward_only

    seqs, done = [list(p) for p in prompts], [False] * len(prompts)
    for _ in range(MAX_NEW):
        lengths = torch.tensor([len(s) for s in seqs])
        ids = torch.full((len(seqs), -(-int(lengths.max()) // multiple) * multiple), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)

        def head(m, hidden, batch, lengths=lengths):  # this step's lengths (called at once, by forward_only)
            logits = m.full_logits(hidden)  # [B, S, V]
            return logits[torch.arange(len(seqs)), lengths - 1].argmax(-1)

        out = forward_only(actor, [{"input_ids": ids}], head)
        nxt = broadcast_from_last_stage(out[0] if out else None, (len(seqs),), torch.long)
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                seqs[i].append(tok)
                done[i] = tok in eos_ids
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def _body(rank, world, model_dir, tp, pp, ep=1):
    import torch.distributed as dist

    from remax_megatron.config import RolloutConfig
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.moe import own_routes
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.batching import pad_sequences
    from remax_megatron.rollout import SamplingParams, build_engine, flatten_rollouts, logprob_mismatch, sync_weights
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    etp = 1 if ep > 1 else tp
    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize(seed=0)
    arch = read_hf_config(model_dir)
    moe = arch.is_moe
    experts = ExpertOptions(ep=ep, etp=etp, routing_replay=True) if moe else None
    sp = moe and tp > 1  # megatron's MoE at TP > 1 with whole experts per rank needs sequence parallel
    actor = build_policy(arch, tp=tp, pp=pp, trainable=False, experts=experts, sequence_parallel=sp)
    load_hf_weights(actor, model_dir)
    engine = build_engine(
        RolloutConfig(engine="native", routing_replay=moe), hf_dir=model_dir, arch=arch, seed=0, dtype=torch.float32
    )
    stats = sync_weights(engine, export_hf_weights(actor, bucket_mb=0.05), bucket_mb=0.05)
    assert stats["buckets"] > 1, stats

    # Fixed sequences.
    ids = torch.randint(4, arch.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[1, :6] = -100
    fixed = {"input_ids": ids, "labels": labels}
    for temperature in (1.0, TEMPERATURE):
        err = (engine.score(ids, labels, temperature) - _actor_logprobs(actor, fixed, temperature)).abs().max()
        assert err < 1e-5, f"fixed sequences, T={temperature}: max |engine - actor| = {err}"

    # Generated rows (rank 0's rollout, so the whole model-parallel group scores the same batch).
    prompts = [[5, 17, 40, 41, 42], [9, 10], [60, 61, 62, 63, 64, 65, 66, 67]]
    results = engine.generate(
        prompts, n=2, sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=3)
    )
    shared = [results]
    dist.broadcast_object_list(shared, src=0)
    results = shared[0]
    rows_p, rows_c = flatten_rollouts(prompts, results)
    batch = pad_sequences(rows_p, rows_c, pad_id=engine.pad_token_id, pad_to_multiple=tp if sp else 1, routes=moe)
    actor_lp = _actor_logprobs(actor, batch, TEMPERATURE)
    mismatch = logprob_mismatch(actor_lp, batch["engine_logprobs"], batch["response_mask"], threshold=1e-5)
    assert mismatch["max"] < 1e-5 and mismatch["tokens"] > 0, mismatch
    if moe:  # routing replay's engine side: in fp32 the engine routes every fed token where the actor does
        given = batch["routed_experts"]
        assert (given >= 0).sum() > 50
        assert torch.equal(given.sort(-1).values, own_routes(actor, batch).sort(-1).values)
    greedy = pad_sequences(
        prompts, [ro.greedy for ro in results], pad_id=engine.pad_token_id, pad_to_multiple=tp if sp else 1
    )
    mismatch = logprob_mismatch(_actor_logprobs(actor, greedy, 1.0), greedy["engine_logprobs"], greedy["response_mask"])
    assert mismatch["max"] < 1e-5, f"greedy rows at T=1: {mismatch}"

    # Greedy == the actor's own argmax decoding.
    expected = _actor_greedy(actor, prompts, engine.eos_token_ids, engine.pad_token_id, tp if sp else 1)
    got = [ro.greedy.token_ids for ro in results]
    assert got == expected, f"engine greedy {got} != actor argmax {expected}"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    # Untied output layer, qkv bias, vocab 300 (not a multiple of 128 * tp: padding rows excluded).
    return make_tiny_model(
        str(tmp_path_factory.mktemp("rollout-parity") / "qwen2"),
        "qwen2",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=96,
        vocab=300,
        seed=9,
    )


@pytest.fixture(scope="module")
def launched(tiny_llama, qwen2, moe_models, tmp_path_factory):
    """Every family in one launch of 4 processes (process starts and imports dominate on CPU); the MoE
    actors at PP2 x EP2 (experts split over the 2 data-parallel ranks of each stage)."""
    cases = {
        f"{family}-tp2-pp2": (_body, (model_dir, 2, 2))
        for family, model_dir in [("llama", tiny_llama), ("qwen2", qwen2)]
    }
    cases.update({f"{family}-pp2-ep2": (_body, (model_dir, 1, 2, 2)) for family, model_dir in moe_models.items()})
    cases["mixtral-tp2-ep2-sp"] = (_body, (moe_models["mixtral"], 2, 1, 2))  # the routes gathered over the SP shards
    return SharedLaunches({4: cases}, str(tmp_path_factory.mktemp("launches")))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_matches_actor_tp2_pp2(family, launched):
    launched.check(f"{family}-tp2-pp2")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_moe-pp2-ep2", "mixtral-pp2-ep2", "mixtral-tp2-ep2-sp", "deepseek_v3-pp2-ep2"])
def test_engine_matches_a_moe_actor_and_routes_where_it_does(case, launched):
    launched.check(case)
