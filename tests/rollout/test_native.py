"""The native engine: one request per generate, greedy = argmax, sampling follows the model,
top-k / top-p / stop strings / EOS, padding invariance, sleep/wake (single process, CPU)."""

import pytest
import torch

from remax_megatron.rollout import SamplingParams
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

    def spy(prompts, per, greedy, seeds, sampling, limits):
        rows = original(prompts, per, greedy, seeds, sampling, limits)
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


# ---- the decode loop (rollout/native_decode.py) against the old one (tests/rollout/_reference_decode.py) ----
def _old_loop(engine, prompts, n, sampling, seeds, limits=None):
    """The pre-issue-49 loop on the same engine: per-row generators seeded as rollout/engine.py says."""
    from tests.rollout._reference_decode import reference_decode

    generators, greedy = [], []
    for seed in seeds:
        generators += [torch.Generator().manual_seed(seed + j) for j in range(n)] + [None]
        greedy += [False] * n + [True]
    limits = limits or [sampling.max_new_tokens] * len(greedy)
    return reference_decode(engine, prompts, n + 1, greedy, generators, sampling, limits)


VARIED = ("hello world", "ab", "The quick brown fox jumps", "x", "0123456789 abc")


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=24, temperature=0.9),
        SamplingParams(max_new_tokens=20, temperature=1.1, stop_token_ids=[40, 41, 50, 60, 70]),
        SamplingParams(max_new_tokens=16, temperature=0.8, top_k=5, stop=["]8", "~~", "JJ", "ssss", "cc"]),
    ],
    ids=["length", "stop-ids", "stop-strings"],
)
def test_greedy_rows_equal_the_old_loop_token_for_token(engine, sampling):
    """Prompts of different lengths, n = 2: every greedy row, its log-probs and finish reason as the old
    loop's (rows end at different steps: stop ids / strings)."""
    prompts = _prompts(engine, VARIED)
    new = engine.generate(prompts, n=2, sampling=sampling, seeds=[11, 12, 13, 14, 15])
    old = _old_loop(engine, prompts, 2, sampling, [11, 12, 13, 14, 15])
    ends = set()
    for p, ro in enumerate(new):
        ref = old[p * 3 + 2]
        assert ro.greedy.token_ids == ref.token_ids, (p, ro.greedy.token_ids, ref.token_ids)
        assert ro.greedy.finish_reason == ref.finish_reason
        assert max(abs(a - b) for a, b in zip(ro.greedy.logprobs, ref.logprobs)) < 1e-5
        ends.add(len(ro.greedy.token_ids))
        for c in ro.sampled:
            ends.add(len(c.token_ids))
    if sampling.stop or sampling.stop_token_ids:
        assert len(ends) > 2, f"rows ended at {ends} tokens only: the stops did not end rows early"


def _teacher_forced(engine, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion.token_ids])
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt) - 1 : -1] = torch.tensor(completion.token_ids)
    return engine.score(ids, labels, temperature)[0, len(prompt) - 1 : -1]


def test_every_completions_logprobs_equal_a_teacher_forced_recomputation(engine):
    """Sampled rows at the sampling temperature, greedy rows at 1 (rollout/engine.py), under top-k / top-p,
    prompts of different lengths, rows ending at different steps: fp32, within 1e-5."""
    prompts = _prompts(engine, VARIED)
    sampling = SamplingParams(max_new_tokens=20, temperature=0.7, top_k=8, top_p=0.9, stop_token_ids=[40, 50, 60])
    out = engine.generate(prompts, n=3, sampling=sampling, seeds=[1, 2, 3, 4, 5])
    worst = 0.0
    for prompt, ro in zip(prompts, out):
        for c, temperature in [(c, 0.7) for c in ro.sampled] + [(ro.greedy, 1.0)]:
            got = torch.tensor(c.logprobs)
            worst = max(worst, (got - _teacher_forced(engine, prompt, c, temperature)).abs().max().item())
    assert worst < 1e-5, worst


def test_per_row_limits_and_greedy_rows_of_generate_rows_equal_the_old_loop(engine):
    """generate_rows (multi-turn): a limit per row, greedy and sampled rows mixed."""
    from tests.rollout._reference_decode import reference_decode

    contexts = _prompts(engine, VARIED)
    greedy = [True, False, True, False, True]
    limits = [3, 7, 12, 1, 9]
    sampling = SamplingParams(max_new_tokens=12, temperature=1.2)
    new = engine.generate_rows(contexts, greedy, sampling, [5, 6, 7, 8, 9], max_new_tokens=limits)
    old = reference_decode(
        engine, contexts, 1, greedy, [None if g else torch.Generator().manual_seed(9) for g in greedy], sampling, limits
    )
    for c, ref, g, limit in zip(new, old, greedy, limits):
        assert len(c.token_ids) == limit and c.finish_reason == "length"
        if g:
            assert c.token_ids == ref.token_ids


def test_waves_give_the_same_rows_as_one_batch(engine, monkeypatch):
    """rollout.kv_cache_gib splits a request into waves: every row (sampled ones too: keyed per row) is the
    same token for token; a budget below one row is refused in one line."""
    from remax_megatron.rollout import native_decode

    prompts = _prompts(engine, VARIED)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=[40, 50])
    whole = engine.generate(prompts, n=2, sampling=sampling, seeds=[7, 8, 9, 10, 11])
    row = native_decode.kv_bytes_per_token(engine.model.config, engine.dtype) * (max(map(len, prompts)) + 10)
    waves = []
    original = native_decode.WaveDecoder

    def spy(*args, **kwargs):
        waves.append(len(args[2]))
        return original(*args, **kwargs)

    monkeypatch.setattr(native_decode, "WaveDecoder", spy)
    monkeypatch.setattr(engine, "kv_cache_bytes", 4 * row)  # 4 rows a wave: 15 rows -> 4 + 4 + 4 + 3
    split = engine.generate(prompts, n=2, sampling=sampling, seeds=[7, 8, 9, 10, 11])
    assert waves == [4, 4, 4, 3]
    for a, b in zip(whole, split):
        for x, y in zip(a.sampled + [a.greedy], b.sampled + [b.greedy]):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
    monkeypatch.setattr(engine, "kv_cache_bytes", row - 1)
    with pytest.raises(ValueError, match=r"rollout.kv_cache_gib=.* holds no row of this request"):
        engine.generate(prompts, n=2, sampling=sampling)


class _HostReads:
    """Counts device-to-host reads (Tensor.tolist / item / cpu / __bool__ / nonzero) while active."""

    METHODS = ("tolist", "item", "cpu", "__bool__", "nonzero")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_64_token_decode_reads_the_host_once_per_check(family, tiny_llama, moe_models, monkeypatch):
    """No per-token host sync: a 64-token decode (no row ends early) reads device tensors at the host checks
    only (tokens 1 to 8, 12, then every 16) plus the prefill's, the MoE model's experts included
    (transformers' grouped-mm experts); the old loop reads several times per token."""
    from remax_megatron.rollout import native_decode

    model_dir = tiny_llama if family == "llama" else moe_models[family]
    engine = native_engine(model_dir)
    if family != "llama":
        assert engine.model.config._experts_implementation != "eager"
    monkeypatch.setattr(engine, "eos_token_ids", set())
    prompts = _prompts(engine, ("hello world", "ab", "The quick"))
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0)
    reads = _HostReads(monkeypatch)
    out = engine.generate(prompts, n=2, sampling=sampling, seeds=[1, 2, 3])
    assert all(len(c.token_ids) == 64 for ro in out for c in ro.sampled + [ro.greedy])
    # one read per 16 tokens (checks 16, 32, 48, 64) + a constant: the 9 early checks and the prefill's 2
    # (transformers' SDPA mask asks whether the prompts' padding mask is all ones)
    assert native_decode.CHECK_EVERY >= 16 and len(native_decode.FIRST_CHECKS) <= 9
    assert reads.count <= 64 // 16 + 9 + 2, f"{reads.count} host reads in a 64-token decode"
    reads.count = 0
    _old_loop(engine, prompts, 2, sampling, [1, 2, 3])
    assert reads.count >= 3 * 64, f"the counter saw only {reads.count} reads of the old loop"


def test_eager_attention_takes_the_additive_mask(tiny_llama):
    """A model on transformers' eager attention gets the decode's mask as an additive one: the same rows."""
    engine = native_engine(tiny_llama, seed=3)
    prompts = _prompts(engine, VARIED)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.9, stop_token_ids=[40, 50])
    sdpa = engine.generate(prompts, n=2, sampling=sampling, seeds=[1, 2, 3, 4, 5])
    engine.model.set_attn_implementation("eager")
    eager = engine.generate(prompts, n=2, sampling=sampling, seeds=[1, 2, 3, 4, 5])
    for a, b in zip(sdpa, eager):
        for x, y in zip(a.sampled + [a.greedy], b.sampled + [b.greedy]):
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5


class _FakeGraph:
    """Stands in for a torch.cuda.CUDAGraph on the CPU: a replay runs the decoder's step, after checking that
    every tensor the capture would have baked in is still the very one it saw (a real graph replays on the
    old storage: the hazard when a compaction replaces the state)."""

    def __init__(self, decoder):
        self.decoder, self.bound = decoder, self.state(decoder)

    @staticmethod
    def state(d):
        tensors = [d.fed, d.position, d.slot, d.step, d.tokens, d.logprobs, d.lengths, d.stopped, d.done]
        tensors += [d.greedy, d.temperature, d.keys, d.limit, d.prompt_mask]
        return [id(t) for t in tensors] + [id(layer.keys) for layer in d.cache.layers]

    def replay(self):
        assert self.state(self.decoder) == self.bound, "a graph replayed on tensors the decoder replaced"
        self.decoder._forward_and_sample()


def test_the_cuda_graph_path_recaptures_after_compaction(engine, monkeypatch):
    """The graph path's bookkeeping on the CPU (a fake graph; tests/gpu runs the real one): captured after two
    eager steps, captured again after finished rows leave the batch (CUDA's rule: half of it), the same rows
    as the eager decode."""
    from remax_megatron.rollout import native_decode

    prompts = _prompts(engine, VARIED)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=list(range(40, 52)))
    eager = engine.generate(prompts, n=2, sampling=sampling, seeds=[3, 4, 5, 6, 7])
    captures, replays = [], []

    class GraphDecoder(native_decode.WaveDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.use_graph, self.compact_share = True, 0.5

        def _capture(self):
            captures.append(self.fed.shape[0])
            self.graph = _FakeGraph(self)

        def decode_step(self):
            replays.append(self.graph is not None)
            super().decode_step()

    monkeypatch.setattr(native_decode, "WaveDecoder", GraphDecoder)
    graphed = engine.generate(prompts, n=2, sampling=sampling, seeds=[3, 4, 5, 6, 7])
    for a, b in zip(eager, graphed):
        for x, y in zip(a.sampled + [a.greedy], b.sampled + [b.greedy]):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5  # other batch sizes
    assert len(captures) >= 2 and captures == sorted(captures, reverse=True) and captures[-1] < captures[0], captures
    assert sum(replays) > len(replays) // 2, replays


@pytest.mark.parametrize(
    "family,options", [("mistral", dict(sliding_window=5)), ("qwen2", dict(sliding_window=5, max_window_layers=1))]
)
def test_windowed_decodes_score_as_a_fresh_transformers_forward(family, options, tmp_path):
    """Sliding windows of 5 keys over rows of up to 31 tokens (Mistral: every layer; Qwen2: the layers past
    max_window_layers): the cached decode's greedy rows are transformers' argmax and every row's log-probs are
    its full forward's, within 1e-5. A decode blind to the window misses both."""
    from transformers import AutoModelForCausalLM

    from remax_megatron.builtin.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / family), family, hidden=64, heads=4, kv_heads=2, seed=7, **options)
    engine = native_engine(path, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(engine, ("hello world", "ab"))
    sampling = SamplingParams(max_new_tokens=20, temperature=0.9)
    out = engine.generate(prompts, n=2, sampling=sampling, seeds=[4, 5])
    for prompt, ro in zip(prompts, out):
        for c, temperature in [(c, 0.9) for c in ro.sampled] + [(ro.greedy, 1.0)]:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1] / temperature
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (torch.tensor(c.logprobs) - want).abs().max() < 1e-5
        assert ro.greedy.token_ids == logits.argmax(-1).tolist()
