"""Megatron actor logits and reward-model scores vs transformers, at several TP x PP layouts (gloo),
with and without sequence parallel, for every registered dense family (Llama tied, Qwen2, Qwen3 tied
and untied with head_dim != hidden / heads, Mistral and Qwen2 with sliding windows shorter than the rows),
reward models of Qwen2, Qwen3 and Mistral, and the MoE families (Qwen3-MoE, Mixtral with a window) at
expert-parallel layouts with both token dispatchers."""

import pytest
import torch

from tests._dist import SharedLaunches
from tools.make_tiny_model import make_tiny_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
ACTORS = ["llama", "qwen2", "qwen3", "qwen3-tied", "mistral", "qwen2-window"]
# model, tp, pp with sequence parallel
SP_CASES = [
    ("llama", 2, 1),
    ("qwen2", 2, 2),
    ("qwen3", 2, 1),
    ("qwen3-tied", 2, 2),
    ("mistral", 2, 1),
    ("qwen2-window", 2, 2),
]
REWARD_MODELS = ["rm", "rm-qwen3", "rm-mistral"]
# MoE: (tp, pp, ep) on (world) processes; TP=2 with sequence parallel (what MoE training needs) and whole
# experts split over EP; both of megatron's token dispatchers
MOE_LAYOUTS = [(1, 1, 1, 1), (1, 1, 2, 2), (2, 1, 2, 4), (1, 2, 2, 4)]
MOE_MODELS = ["qwen3_moe", "mixtral"]
DISPATCHERS = ["alltoall", "allgather"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # 4 layers of hidden 64, GQA 4 heads / 2 kv heads, MLP 96 (MoE: 4 experts of 32, 2 per token); vocab 300
    # (not a multiple of 128 * tp) unless chars only
    dense = dict(hidden=64, layers=4, heads=4, kv_heads=2, ffn=96)
    wide = dict(dense, vocab=300)
    moe = dict(wide, ffn=32, experts=4, top_k=2)

    def model(name, family, **options):
        return make_tiny_model(str(root / name), family, **options)

    return {
        # Llama: tied embeddings, vocab 104 (chars only).
        "llama": model("llama", "llama", **dense, tie=True, seed=1),
        # Qwen2: untied, qkv bias.
        "qwen2": model("qwen2", "qwen2", **wide, rope_theta=1e6, seed=2),
        # Qwen3: q/k norms per head, head_dim 32 != hidden / heads (16), untied; and a tied one.
        "qwen3": model("qwen3", "qwen3", **wide, head_dim=32, rope_theta=1e6, seed=5),
        "qwen3-tied": model("qwen3-tied", "qwen3", **dense, tie=True, seed=6),
        # Mistral: a sliding window of 6 on every layer, shorter than the 17-token rows (and than the packed
        # documents: the window applies inside each).
        "mistral": model("mistral", "mistral", **wide, head_dim=32, sliding_window=6, max_positions=2048, seed=7),
        # Qwen2 with use_sliding_window: layers 0-1 full, 2-3 a window of 5 (max_window_layers=2)
        "qwen2-window": model("qwen2-window", "qwen2", **wide, sliding_window=5, max_window_layers=2, seed=12),
        "rm": model("rm", "qwen2", **wide, reward=True, seed=3),
        # MoE: Qwen3-MoE renormalises the top-k (norm_topk_prob); Mixtral windows every layer (shorter than the rows)
        "qwen3_moe": model("qwen3_moe", "qwen3_moe", **moe, seed=10),
        "mixtral": model("mixtral", "mixtral", **moe, sliding_window=7, seed=11),
        "rm-qwen3": model("rm-qwen3", "qwen3", **wide, head_dim=32, reward=True, seed=8),
        "rm-mistral": model("rm-mistral", "mistral", **wide, reward=True, seed=9),
    }


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    """check(case): every multi-process case of this module runs in one launch per world size (process
    starts and imports are most of a small case's time on CPU); transformers' outputs computed once."""
    logits = {name: _hf_logits(models[name]) for name in ACTORS + MOE_MODELS}
    scores = {name: _hf_scores(models[name]) for name in REWARD_MODELS}
    cases = {1: {}, 2: {}, 4: {}}
    for name in ACTORS:
        for tp, pp in LAYOUTS:
            cases[tp * pp][f"actor-{name}-{tp}-{pp}"] = (_actor_body, (models[name], tp, pp, logits[name]))
    for name, tp, pp in SP_CASES:
        cases[tp * pp][f"actor-sp-{name}-{tp}-{pp}"] = (_actor_body, (models[name], tp, pp, logits[name], True))
    cases[2]["odd-length"] = (_odd_length_body, (models["llama"],))
    for name in MOE_MODELS:
        for tp, pp, ep, world in MOE_LAYOUTS:
            for dispatcher in DISPATCHERS:
                cases[world][f"moe-{name}-{tp}{pp}{ep}-{dispatcher}"] = (
                    _moe_body,
                    (models[name], tp, pp, ep, dispatcher, logits[name]),
                )
    for name in REWARD_MODELS:
        for tp, pp in LAYOUTS:
            cases[tp * pp][f"{name}-{tp}-{pp}"] = (_rm_body, (models[name], tp, pp, scores[name]))
        cases[2][f"{name}-sp"] = (_rm_body, (models[name], 2, 1, scores[name], True))
    rope_path, ids, expected, moved = _llama3_rope_case(tmp_path_factory.mktemp("rope"))
    cases[2]["rope"] = (_rope_body, (rope_path, ids, expected))
    for variant, path in (("llama3", rope_path), ("default", rope_path + "-plain"), ("window", models["mistral"])):
        cases[1][f"packed-{variant}"] = (_packed_body, (path, *_packed_case(path)))
    top = str(tmp_path_factory.mktemp("launches"))
    return SharedLaunches(cases, top), moved


def _inputs(vocab):
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, vocab, (3, 17), generator=g)


def _hf_logits(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = _inputs(model.config.vocab_size)
    with torch.no_grad():
        return model(ids).logits


def _labels(ids):
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :5] = -100  # e.g. prompt tokens
    return labels


def _sp_pad(ids, labels_or_none, fill):
    """Sequence parallel at TP=2 needs an even length: one trailing column (a causal model's earlier
    positions cannot see it; labels there are ignored)."""
    ids = torch.cat([ids, ids[:, :1].clone().fill_(fill)], dim=1)
    if labels_or_none is None:
        return ids, None
    return ids, torch.cat([labels_or_none, torch.full_like(labels_or_none[:, :1], -100)], dim=1)


def _actor_body(rank, world, model_dir, tp, pp, expected, sp=False):
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=tp, pp=pp, world_size=world).initialize()
    arch = read_hf_config(model_dir)
    model = build_policy(arch, tp=tp, pp=pp, sequence_parallel=sp)
    assert model.config.sequence_parallel == sp
    load_hf_weights(model, model_dir)
    ids = _inputs(arch.vocab_size)
    labels = _labels(ids)
    S = ids.shape[1]
    if sp:
        ids, labels = _sp_pad(ids, labels, fill=5)

    def head(m, hidden, batch):
        logprobs, entropy = m.token_logprobs(hidden, batch["labels"], temperature=0.7, with_entropy=True)
        return m.full_logits(hidden)[:, :S], logprobs[:, :S], entropy[:, :S]

    out = forward_only(
        model,
        [
            {"input_ids": ids[:2], "labels": labels[:2]},
            {"input_ids": ids[2:].expand(2, -1), "labels": labels[2:].expand(2, -1)},
        ],
        head,
    )
    if model.post_process:
        logits = torch.cat([out[0][0], out[1][0][:1]])
        assert logits.shape == expected.shape, (logits.shape, expected.shape)
        err = (logits - expected).abs().max().item()
        assert err < 1e-5, f"tp={tp} pp={pp}: max |logits - transformers| = {err}"
        # Fused vocab-parallel log-probs (padding rows excluded) vs log_softmax of HF logits.
        ref = torch.log_softmax(expected.double() / 0.7, dim=-1)
        labels = labels[:, :S]
        ref_lp = ref.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(labels < 0, 0)
        ref_ent = -(ref.exp() * ref).sum(-1).masked_fill(labels < 0, 0)
        logprobs = torch.cat([out[0][1], out[1][1][:1]])
        entropy = torch.cat([out[0][2], out[1][2][:1]])
        assert (logprobs.double() - ref_lp).abs().max().item() < 1e-5
        assert (entropy.double() - ref_ent).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("model", ACTORS)
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_actor_logits_match_transformers(launched, model, tp, pp):
    launched[0].check(f"actor-{model}-{tp}-{pp}")


@pytest.mark.slow
@pytest.mark.parametrize("model,tp,pp", SP_CASES)
def test_actor_sequence_parallel_matches_transformers(launched, model, tp, pp):
    launched[0].check(f"actor-sp-{model}-{tp}-{pp}")


def _moe_body(rank, world, model_dir, tp, pp, ep, dispatcher, expected):
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    etp = 1 if ep > 1 else tp
    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize()
    arch = read_hf_config(model_dir)
    model = build_policy(
        arch, tp=tp, pp=pp, sequence_parallel=tp > 1, experts=ExpertOptions(ep=ep, etp=etp, dispatcher=dispatcher)
    )
    load_hf_weights(model, model_dir)
    ids = _inputs(arch.vocab_size)
    S = ids.shape[1]
    if tp > 1:
        ids, _ = _sp_pad(ids, None, fill=5)
    (logits,) = forward_only(model, [{"input_ids": ids}], lambda m, hidden, batch: m.full_logits(hidden)[:, :S]) or (
        None,
    )
    if logits is not None:
        err = (logits - expected).abs().max().item()
        assert err < 1e-5, f"{arch.architecture} tp={tp} pp={pp} ep={ep} {dispatcher}: max |logits - HF| = {err}"


@pytest.mark.slow
@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("tp,pp,ep,world", MOE_LAYOUTS)
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_moe_logits_match_transformers(launched, model, tp, pp, ep, world, dispatcher):
    launched[0].check(f"moe-{model}-{tp}{pp}{ep}-{dispatcher}")


def _odd_length_body(rank, world, model_dir):
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout

    ParallelLayout(tp=2, pp=1, world_size=world).initialize()
    model = build_policy(read_hf_config(model_dir), tp=2, pp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 17 is not a multiple of tp=2"):
        forward_only(model, [{"input_ids": torch.ones(2, 17, dtype=torch.long)}], lambda m, h, b: h)


@pytest.mark.slow
def test_sequence_parallel_refuses_odd_length_on_every_rank(launched):
    launched[0].check("odd-length")


def _rm_body(rank, world, model_dir, tp, pp, expected, sp=False):
    from remax_megatron.models import build_reward_model, read_hf_config
    from remax_megatron.models.forward import broadcast_from_last_stage, forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=tp, pp=pp, world_size=world).initialize()
    arch = read_hf_config(model_dir)
    model = build_reward_model(arch, tp=tp, pp=pp, sequence_parallel=sp)
    load_hf_weights(model, model_dir)
    ids, lengths = _rm_inputs(arch.vocab_size, arch.pad_token_id)
    if sp:
        ids, _ = _sp_pad(ids, None, fill=arch.pad_token_id)
    positions = model.score_positions(ids, lengths, arch.pad_token_id)
    out = forward_only(
        model,
        [{"input_ids": ids, "positions": positions}],
        lambda m, values, batch: m.scores(values, batch["positions"]),
    )
    scores = broadcast_from_last_stage(out[0] if out else None, (ids.shape[0],), torch.float32)
    err = (scores - expected).abs().max().item()
    assert err < 1e-5, f"tp={tp} pp={pp}: max |score - transformers| = {err}"


def _rm_inputs(vocab, pad):
    ids = _inputs(vocab)
    lengths = torch.tensor([17, 9, 3])
    for i, n in enumerate(lengths):
        ids[i, n:] = pad  # right padding, as the trainer packs sequences
    return ids, lengths


def _hf_scores(model_dir):
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, _ = _rm_inputs(hf.config.vocab_size, hf.config.pad_token_id)
    with torch.no_grad():
        return hf(ids).logits.view(-1).float()


@pytest.mark.slow
@pytest.mark.parametrize("model", REWARD_MODELS)
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_reward_model_scores_match_transformers(launched, model, tp, pp):
    launched[0].check(f"{model}-{tp}-{pp}")


@pytest.mark.slow
@pytest.mark.parametrize("model", REWARD_MODELS)
def test_reward_model_sequence_parallel_matches_transformers(launched, model):
    launched[0].check(f"{model}-sp")


def _rope_body(rank, world, model_dir, ids, expected):
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=world, pp=1, world_size=world).initialize()
    arch = read_hf_config(model_dir)
    assert arch.rope_scaling_factor == 8.0
    model = build_policy(arch, tp=world, pp=1)
    load_hf_weights(model, model_dir)
    (logits,) = forward_only(model, [{"input_ids": ids}], lambda m, hidden, batch: m.full_logits(hidden))
    err = (logits - expected).abs().max().item()
    assert err < 1e-5, f"llama3 RoPE scaling: max |logits - transformers| = {err}"


def _llama3_rope_case(top):
    """(model dir, ids, transformers' logits, how far the scaling moved them) for the rope test."""
    import json

    from transformers import AutoModelForCausalLM

    path = make_tiny_model(
        str(top / "llama3"),
        "llama",
        hidden=128,
        layers=2,
        heads=2,
        kv_heads=2,
        ffn=96,
        rope_theta=500000.0,
        max_positions=16384,
        seed=4,
    )
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    plain = dict(config)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config["rope_parameters"] = rope
    config["rope_scaling"] = rope
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    ids = torch.randint(4, config["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        unscaled_dir = path + "-plain"
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(unscaled_dir)
        with open(f"{unscaled_dir}/config.json", "w") as f:
            json.dump(plain, f)
        unscaled = AutoModelForCausalLM.from_pretrained(unscaled_dir, dtype=torch.float32).eval()(ids).logits
    moved = (expected - unscaled).abs().max().item()
    return path, ids, expected, moved


@pytest.mark.slow
def test_llama3_rope_scaling_matches_transformers(launched):
    """rope_type=llama3 (factor 8, megatron's fixed low/high frequency factors and 8192 original
    length) gives transformers' logits over 1024 positions, where the scaling moves them far more
    than the tolerance."""
    moved = launched[1]
    assert moved > 1e-3, f"the scaling must matter at these positions (moved the logits by {moved})"
    launched[0].check("rope")


PACKED_LENGTHS = [1900, 40, 37]  # one packed row: the short sequences start at positions 1900 and 1940


def _packed_case(model_dir):
    """(sequences, transformers' logits of each alone) for the packed-row test."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sequences = [torch.randint(4, model.config.vocab_size, (n,), generator=g) for n in PACKED_LENGTHS]
    with torch.no_grad():
        return sequences, [model(seq[None]).logits[0] for seq in sequences]


def _packed_body(rank, world, model_dir, sequences, expected):
    """Three sequences in one packed row (remax_megatron.batching: megatron's THD format, each document attended
    alone by models/attention.py, RoPE at the row's positions): each one's logits equal transformers' on that
    sequence alone, the last two starting 1900 and 1940 positions into the row."""
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.models.forward import forward_only
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.batching.micro_batches import MicroBatch, assemble, model_inputs, to_sequences
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize()
    model = build_policy(read_hf_config(model_dir), tp=1, pp=1)
    load_hf_weights(model, model_dir)
    width = max(PACKED_LENGTHS)
    ids = torch.zeros(3, width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
    batch = {"input_ids": ids, "labels": torch.full_like(ids, -100), "lengths": torch.tensor(PACKED_LENGTHS)}
    row = sum(PACKED_LENGTHS)
    mb = assemble(batch, MicroBatch([0, 1, 2], width, bins=[[0, 1, 2]], row_width=row))
    assert mb["input_ids"].shape == (1, row)

    def head(m, hidden, micro):
        logits = m.full_logits(hidden)  # [1, row, vocab]
        return torch.stack([to_sequences(micro, logits[..., v]) for v in range(logits.shape[-1])], -1)

    (logits,) = forward_only(model, [mb], head, inputs=model_inputs)  # [3, width, vocab]
    for i, (seq, ref) in enumerate(zip(sequences, expected)):
        err = (logits[i, : len(seq)] - ref).abs().max().item()
        assert err < 1e-5, f"sequence {i} of the packed row: max |logits - transformers| = {err}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "llama3", "window"])
def test_packed_row_matches_each_sequence_alone(launched, variant):
    """Issue 29: packed rows keep attention inside each sequence, and RoPE at the row's positions (megatron
    ignores position ids) gives each sequence its own logits, plain and llama3-scaled, 1900+ positions in;
    with a sliding window (Mistral, 6 tokens) inside each sequence."""
    launched[0].check(f"packed-{variant}")
