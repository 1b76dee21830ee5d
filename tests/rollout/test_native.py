"""The native engine: one request per generate, greedy = argmax, sampling follows the model,
top-k / top-p / stop strings / EOS, padding invariance, sleep/wake (single process, CPU)."""

import pytest
import torch

from remax_megatron.rollout import SamplingParams
from remax_megatron.rollout.native import filter_logits
from tests.rollout.helpers import assert_chi_square, native_engine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return native_engine(tiny_llama, seed=3)


def _prompts(engine, texts=("hello world", "ab", "The quick brown fox")):
    return [engine.tokenizer(t)["input_ids"] for t in texts]


def _next_logits(engine, ids):
    """Logits [V] after the token list `ids`: a full forward, no KV cache, no padding."""
    with torch.no_grad():
        return engine.model(torch.tensor([ids])).logits[0, -1].float()


def test_one_request_carries_sampled_and_greedy(engine, monkeypatch):
    calls = []
    original = engine._decode

    def spy(prompts, per, greedy, generators, sampling, limits):
        rows = original(prompts, per, greedy, generators, sampling, limits)
        calls.append((len(prompts), per - 1, len(rows)))
        return rows

    monkeypatch.setattr(engine, "_decode", spy)
    before = engine.num_requests
    prompts = _prompts(engine)
    out = engine.generate(prompts, n=3, sampling=SamplingParams(max_new_tokens=5, temperature=0.8))
    assert engine.num_requests - before == 1
    assert calls == [(3, 3, 3 * 4)]
    assert len(out) == 3
    for ro in out:
        assert len(ro.sampled) == 3
        for c in ro.sampled + [ro.greedy]:
            assert 1 <= len(c.token_ids) <= 5 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert all(lp <= 0 for lp in c.logprobs)


def test_greedy_is_argmax_decoding(engine):
    prompts = _prompts(engine)
    out = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=12, temperature=1.7))
    for prompt, ro in zip(prompts, out):
        seq = list(prompt)
        for token, logprob in zip(ro.greedy.token_ids, ro.greedy.logprobs):
            logits = _next_logits(engine, seq)
            assert token == int(logits.argmax()), "greedy row did not take argmax"
            # Greedy log-probs are at temperature 1 (the convention in rollout/engine.py).
            assert abs(logprob - torch.log_softmax(logits, -1)[token].item()) < 1e-5
            seq.append(token)


def test_sampled_logprobs_are_at_the_sampling_temperature(engine):
    prompts = _prompts(engine)
    out = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=6, temperature=0.6, seed=1))
    for prompt, ro in zip(prompts, out):
        for c in ro.sampled:
            seq = list(prompt)
            for token, logprob in zip(c.token_ids, c.logprobs):
                ref = torch.log_softmax(_next_logits(engine, seq) / 0.6, -1)[token].item()
                assert abs(logprob - ref) < 1e-5
                seq.append(token)


def test_left_padding_does_not_change_results(engine):
    short, long = _prompts(engine, ("ab", "a much longer prompt than the other one"))
    alone = engine.generate([short], n=1, sampling=SamplingParams(max_new_tokens=10))[0].greedy
    batched = engine.generate([long, short], n=1, sampling=SamplingParams(max_new_tokens=10))[1].greedy
    assert alone.token_ids == batched.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < 1e-5


def test_seeded_calls_reproduce(engine):
    prompts = _prompts(engine)
    sp = SamplingParams(max_new_tokens=8, seed=11)
    a = engine.generate(prompts, n=2, sampling=sp)
    b = engine.generate(prompts, n=2, sampling=sp)
    assert [c.token_ids for ro in a for c in ro.sampled] == [c.token_ids for ro in b for c in ro.sampled]
    c = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=8))
    d = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=8))
    assert [x.token_ids for ro in c for x in ro.sampled] != [x.token_ids for ro in d for x in ro.sampled]


def _first_tokens(engine, prompt, n, sampling):
    out = engine.generate([prompt], n=n, sampling=sampling)[0]
    return torch.bincount(torch.tensor([c.token_ids[0] for c in out.sampled]), minlength=engine.model.config.vocab_size)


def test_sampling_at_temperature_1_follows_the_model(engine):
    prompt = _prompts(engine, ("hello",))[0]
    counts = _first_tokens(engine, prompt, 4000, SamplingParams(max_new_tokens=1, temperature=1.0, seed=7))
    assert_chi_square(counts, torch.softmax(_next_logits(engine, prompt), -1))


@pytest.fixture(scope="module")
def sharp_engine(tiny_llama):
    # Final norm x2: a peaked next-token distribution, so top-k / top-p cut real mass.
    return native_engine(tiny_llama, seed=4, scale_final_norm=2.0)


def test_top_k_is_respected_and_renormalised(sharp_engine):
    prompt = _prompts(sharp_engine, ("hello",))[0]
    counts = _first_tokens(
        sharp_engine, prompt, 3000, SamplingParams(max_new_tokens=1, temperature=0.7, top_k=6, seed=2)
    )
    scaled = _next_logits(sharp_engine, prompt) / 0.7
    allowed = torch.topk(scaled, 6).indices
    outside = counts.clone()
    outside[allowed] = 0
    assert outside.sum() == 0, f"sampled tokens outside the top-6: {outside.nonzero().flatten().tolist()}"
    probs = torch.zeros_like(scaled)
    probs[allowed] = torch.softmax(scaled[allowed], -1)
    assert_chi_square(counts, probs)


def test_top_p_is_respected_and_renormalised(sharp_engine):
    prompt = _prompts(sharp_engine, ("hello",))[0]
    counts = _first_tokens(
        sharp_engine, prompt, 3000, SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.6, seed=3)
    )
    probs = torch.softmax(_next_logits(sharp_engine, prompt), -1)
    sorted_p, order = torch.sort(probs, descending=True)
    keep = order[(sorted_p.cumsum(0) - sorted_p) < 0.6]
    assert 1 < len(keep) < len(probs), "the test distribution must make top-p cut"
    outside = counts.clone()
    outside[keep] = 0
    assert outside.sum() == 0, f"sampled tokens outside the nucleus: {outside.nonzero().flatten().tolist()}"
    nucleus = torch.zeros_like(probs)
    nucleus[keep] = probs[keep] / probs[keep].sum()
    assert_chi_square(counts, nucleus)


def test_filter_logits_keeps_the_top_token_and_ties():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).sum(-1).tolist() == [3, 4]
    assert torch.isfinite(filter_logits(logits, 0, 1e-6)).sum(-1).tolist() == [1, 1]


def test_stop_string_ends_the_completion(engine):
    prompt = _prompts(engine, ("hello world",))[0]
    free = engine.generate([prompt], n=1, sampling=SamplingParams(max_new_tokens=12))[0].greedy
    text = engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = text[4:6]
    expected_end = text.index(stop) + len(stop)
    out = engine.generate([prompt], n=1, sampling=SamplingParams(max_new_tokens=12, stop=[stop]))[0].greedy
    assert out.finish_reason == "stop"
    got = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert got == text[:expected_end], (got, text, stop)
    assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_eos_ends_the_completion_and_is_kept(engine, monkeypatch):
    prompt = _prompts(engine, ("hello world",))[0]
    free = engine.generate([prompt], n=1, sampling=SamplingParams(max_new_tokens=12))[0].greedy
    assert free.finish_reason == "length"
    eos = free.token_ids[3]
    monkeypatch.setattr(engine, "eos_token_ids", {eos})
    out = engine.generate([prompt], n=1, sampling=SamplingParams(max_new_tokens=12))[0].greedy
    first = free.token_ids.index(eos)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_stop_token_ids_end_the_completion_and_are_kept(engine):
    """rollout.stop_token_ids: more ids that end a completion as EOS does (the variable-length benchmark's
    stop set)."""
    prompt = _prompts(engine, ("hello world",))[0]
    free = engine.generate([prompt], n=1, sampling=SamplingParams(max_new_tokens=12))[0].greedy
    stop = free.token_ids[4]
    out = engine.generate([prompt], n=1, sampling=SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))[0].greedy
    first = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_sleep_wake_and_unsynced_engine(engine, tiny_llama):
    from remax_megatron.rollout.native import NativeEngine

    engine.sleep()
    assert engine.asleep
    out = engine.generate(_prompts(engine, ("ab",)), n=1, sampling=SamplingParams(max_new_tokens=2))
    assert not engine.asleep and len(out[0].greedy.token_ids) >= 1
    fresh = NativeEngine(hf_dir=tiny_llama, device="cpu")
    with pytest.raises(RuntimeError, match="before any sync_weights"):
        fresh.generate([[5, 6]], n=1, sampling=SamplingParams(max_new_tokens=2))


def test_score_matches_transformers(engine, tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[0, :4] = -100
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits / 0.8, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ref = ref.masked_fill(labels < 0, 0)
    assert (engine.score(ids, labels, temperature=0.8) - ref).abs().max() < 1e-5


def test_a_prompts_samples_depend_on_its_seed_only(engine):
    """Seed convention (rollout/engine.py): prompt p's sample j draws from stream seeds[p] + j, so a
    prompt decoded alone, or beside other prompts (another rank's share), samples the same tokens."""
    a, b = _prompts(engine, ("hello world", "ab"))
    sp = SamplingParams(max_new_tokens=8, temperature=1.3)
    together = engine.generate([a, b], n=3, sampling=sp, seeds=[101, 202])
    alone = engine.generate([b], n=3, sampling=sp, seeds=[202])
    assert [c.token_ids for c in together[1].sampled] == [c.token_ids for c in alone[0].sampled]
    assert len({tuple(c.token_ids) for c in together[1].sampled}) > 1, "samples of a prompt share one stream"
    other = engine.generate([b], n=3, sampling=sp, seeds=[203])
    assert [c.token_ids for c in other[0].sampled] != [c.token_ids for c in alone[0].sampled]
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        engine.generate([b], n=1, sampling=sp, seeds=[1, 2])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_recorded_routes_are_the_experts_each_fed_token_went_to(family, moe_models):
    """routing replay's engine side: every token the engine fed through the model (prompt, then each
    response token but the last), with the experts a full no-cache forward of the same tokens routes it
    to; rows that finish early and rows that leave the batch keep their own routes."""
    from remax_megatron.rollout import sync_weights
    from remax_megatron.rollout.native import NativeEngine, RouteRecorder
    from tests.rollout.helpers import hf_stream

    model_dir = moe_models[family]
    engine = NativeEngine(hf_dir=model_dir, seed=0, dtype=torch.float32, device="cpu", routes=True)
    sync_weights(engine, hf_stream(model_dir), bucket_mb=1)
    prompts = _prompts(engine)
    eos = sorted(engine.eos_token_ids)
    out = engine.generate(
        prompts, n=3, sampling=SamplingParams(max_new_tokens=8, temperature=1.5, stop_token_ids=list(range(40, 60)))
    )
    full = RouteRecorder(engine.model, engine.family)
    lengths = set()
    for prompt, rollout in zip(prompts, out):
        for c in rollout.sampled + [rollout.greedy]:
            fed = prompt + c.token_ids[:-1]
            assert c.routed_experts.shape == (len(fed), 2, 2), c.routed_experts.shape  # [tokens, layers, top_k]
            with torch.no_grad():
                engine.model(torch.tensor([fed]))
            want = full.take(1, len(fed))[0]
            assert torch.equal(c.routed_experts.sort(-1).values, want.sort(-1).values)
            lengths.add(len(c.token_ids))
    assert len(lengths) > 1, f"every row ran {lengths} tokens: no row left the batch early (eos {eos})"


def test_routes_of_a_dense_model_are_refused_in_one_line(tiny_llama):
    from remax_megatron.rollout.native import NativeEngine

    with pytest.raises(ValueError, match="no top-k router"):
        NativeEngine(hf_dir=tiny_llama, device="cpu", routes=True)
