"""What the model-family tests (GLM-4.5, gpt-oss, DeepSeek-V3) and the converter test share: a config edit,
the converters' round trip, the padded parity rows and transformers' log-probs over them, the parity rule,
LoRA on attention, routing replay, a model with an MTP layer and a 3-step training run.

The `*_body` functions run in every process of a launch (tests/_dist.py), so they stay module-level."""

import json
import os
import shutil

import pytest
import torch

from remax_megatron.models import read_hf_config
from tests._dist import run_main

LENGTH = 18  # the parity rows' length: 17 tokens of the longest row and one pad


def edit_config(src, dst, **changes):
    """A copy of the model directory `src` with config.json fields changed."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def round_trip_body(rank, world, hf, ckpt, out, to_megatron, to_hf, check_source=None):
    """HF -> megatron -> HF through both converters' own functions, layouts (tp, pp, ep, etp): every tensor back
    bitwise, dtype included. `check_source(tensors)`: a family's own check of the source checkpoint."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tools import convert_hf_to_megatron, convert_megatron_to_hf

    tp, pp, ep, etp = to_megatron
    convert_hf_to_megatron.convert(hf, ckpt, tp=tp, pp=pp, ep=ep, etp=etp)
    tp, pp, ep, etp = to_hf
    convert_megatron_to_hf.convert(ckpt, out, tp=tp, pp=pp, ep=ep, etp=etp)
    if rank == 0:
        before, after = (load_file(os.path.join(d, "model.safetensors")) for d in (hf, out))
        assert sorted(before) == sorted(after)
        if check_source:
            check_source(before)
        bad = [n for n, t in before.items() if after[n].dtype != t.dtype or not torch.equal(after[n], t)]
        assert not bad, bad[:5]
    dist.barrier()


def rows(vocab):
    """Three right-padded rows of lengths 17, 11, 6 (pad id 0) and their labels (-100: no label)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (3, LENGTH), generator=g)
    lengths = torch.tensor([17, 11, 6])
    valid = torch.arange(LENGTH)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~valid, 0)
    labels = torch.roll(ids, -1, 1).masked_fill(~(torch.arange(LENGTH)[None, :] < (lengths - 1)[:, None]), -100)
    return ids, labels


def hf_logprobs(model_dir, **load):
    """transformers' fp32 log-probs of `rows` ([3, LENGTH], 0 where no label); `load`: from_pretrained options."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).eval()
    ids, labels = rows(model.config.vocab_size)
    with torch.no_grad():  # right padding: a causal model's earlier positions never see it
        logits = model(ids, attention_mask=(labels >= 0) | (torch.arange(LENGTH) == 0)).logits.double()
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return lp.masked_fill(labels < 0, 0)


def tie_rule(gaps: torch.Tensor) -> tuple[float, float]:
    """(max, median) |gap| over the labelled tokens; the MoE tie rule: max <= 1e-4, median <= 1e-5."""
    return gaps.max().item(), gaps.median().item()


def assert_parity(model, vocab, expected, breaks, tp, pp, ep):
    """megatron's fp32 log-probs of `rows(vocab)` vs transformers' (`expected`) under the MoE tie rule; with
    `breaks` (the mapping broken on purpose) they must differ by more than 1e-3 instead."""
    from remax_megatron.models.forward import broadcast_from_last_stage, forward_only

    ids, labels = rows(vocab)
    out = forward_only(
        model,
        [{"input_ids": ids, "labels": labels}],
        lambda m, hidden, batch: m.token_logprobs(hidden, batch["labels"])[0],
    )
    lp = broadcast_from_last_stage(out[0] if out else None, ids.shape, torch.float32)
    gaps = (lp.double() - expected).abs()[labels >= 0]
    worst, median = tie_rule(gaps)
    if breaks:
        assert worst > 1e-3, f"broken mapping {breaks} still matches transformers: max {worst}"
    else:
        assert worst <= 1e-4 and median <= 1e-5, f"tp={tp} pp={pp} ep={ep}: max {worst}, median {median}"


def attention_lora_model(world, model_dir):
    """A 4-layer MoE model from `model_dir` with LoRA on attention's fused qkv and output projection, weights
    loaded; the default targets (the experts among them) refused first."""
    from remax_megatron.models import build_policy
    from remax_megatron.models.arch import ExpertOptions, LoraOptions
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights

    ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    arch = read_hf_config(model_dir)
    with pytest.raises(ValueError, match="is a MoE expert; LoRA on experts is not supported"):
        build_policy(arch, tp=1, pp=1, experts=ExpertOptions(), lora=LoraOptions(rank=4, alpha=8.0))
    lora = LoraOptions(rank=4, alpha=8.0, targets=("linear_qkv", "linear_proj"))
    model = build_policy(arch, tp=1, pp=1, experts=ExpertOptions(), lora=lora)
    adapted = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapted) == 4 * 2 * 2, adapted  # 4 layers x (qkv, proj) x (A, B)
    load_hf_weights(model, model_dir)
    return model


def replay_body(rank, world, model_dir, tp, pp, ep, etp, dense_layers):
    """Routing replay: the native engine's routes (by global layer, -1 at the `dense_layers` first layers) are
    where the actor routes every fed token, and replaying them gives the actor's own log-probs."""
    import torch.distributed as dist

    from remax_megatron.batching import pad_sequences
    from remax_megatron.config import RolloutConfig
    from remax_megatron.models import build_policy
    from remax_megatron.models.arch import ExpertOptions
    from remax_megatron.models.moe import end_replay, own_routes, replay_routes
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.rollout import SamplingParams, build_engine, flatten_rollouts, sync_weights
    from remax_megatron.weights import export_hf_weights, load_hf_weights
    from tests.rollout.test_actor_parity import _actor_logprobs

    ParallelLayout(tp=tp, pp=pp, world_size=world, ep=ep, etp=etp).initialize(seed=0)
    arch = read_hf_config(model_dir)
    experts = ExpertOptions(ep=ep, etp=etp, routing_replay=True)
    actor = build_policy(arch, tp=tp, pp=pp, trainable=False, experts=experts, sequence_parallel=tp > 1)
    load_hf_weights(actor, model_dir)
    engine = build_engine(
        RolloutConfig(engine="native", routing_replay=True), hf_dir=model_dir, arch=arch, seed=0, dtype=torch.float32
    )
    sync_weights(engine, export_hf_weights(actor, bucket_mb=0.05), bucket_mb=0.05)
    prompts = [[5, 17, 40, 41, 42], [9, 10], [60, 61, 62, 63, 64, 65, 66, 67]]
    results = [engine.generate(prompts, n=2, sampling=SamplingParams(temperature=0.7, max_new_tokens=8, seed=3))]
    dist.broadcast_object_list(results, src=0)  # rank 0's rollout: the whole group scores one batch
    rows_p, rows_c = flatten_rollouts(prompts, results[0])
    batch = pad_sequences(rows_p, rows_c, pad_id=engine.pad_token_id, pad_to_multiple=tp, routes=True)
    given = batch["routed_experts"]  # [B, S, layers, top_k] by global layer (vLLM's layout)
    assert given.shape[2] == arch.num_layers == 4 and (given[:, :, :dense_layers] == -1).all()
    assert (given >= 0).sum() > 50
    assert torch.equal(given.sort(-1).values, own_routes(actor, batch).sort(-1).values)
    live = _actor_logprobs(actor, batch, 0.7)
    replay_routes(actor, given.to(torch.long))
    replayed = _actor_logprobs(actor, batch, 0.7)
    end_replay(actor)
    gap = ((replayed - live).abs() * batch["response_mask"]).max().item()
    assert gap <= 1e-6, f"replaying the engine's routes moved the actor's log-probs by {gap}"


def with_mtp_layer(model_dir, dst, tensors):
    """`model_dir` as a published checkpoint stores it: num_nextn_predict_layers 1 and that layer's `tensors`
    (model.layers.4.*) after the decoder layers."""
    from safetensors.torch import load_file, save_file

    edit_config(model_dir, dst, num_nextn_predict_layers=1)
    stored = load_file(os.path.join(dst, "model.safetensors"))
    save_file({**stored, **tensors}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def three_steps(model, out, engine, *overrides) -> list[dict]:
    """The training records of a 3-step ReMax run of `model` (the tiny CPU config, TP2 sequence-parallel actor)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    argv = [
        "--config",
        "configs/tiny_cpu.yaml",
        f"trainer.output_dir={out}",
        "logging.progress_bar=false",
        f"actor.model={model}",
        "actor.sequence_parallel=true",
        f"rollout.engine={engine}",
        "trainer.steps=3",
        "trainer.eval_every=0",
        *overrides,
    ]
    r = run_main("remax_megatron.train", argv, 2, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if '"loss"' in line]
