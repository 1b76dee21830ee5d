"""HFExporter at TP=2 x PP=2 (4 gloo processes): bitwise HF tensors with many buckets, dtype cast before
sending, the same stream on every rank, and buffer reuse that never serves stale weights."""

import pytest
import torch

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model


def _body(rank, world, model_dir):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.weights import load_hf_weights
    from remax_megatron.weights.export import HFExporter, export_hf_weights

    ParallelLayout(tp=2, pp=2, world_size=world).initialize(seed=0)
    arch = read_hf_config(model_dir)
    actor = build_policy(arch, tp=2, pp=2, trainable=False)
    load_hf_weights(actor, model_dir)
    hf = load_file(f"{model_dir}/model.safetensors")

    # 20 kB buckets: many buckets, and tensors larger than a bucket go alone (embedding: 301 x 64 x 4 B).
    exporter = HFExporter(actor, bucket_mb=0.02)
    assert len(exporter.plan) > 8
    names = []
    for name, tensor in exporter:
        assert tensor.dtype == hf[name].dtype and torch.equal(tensor, hf[name]), name
        names.append(name)
    assert sorted(names) == sorted(hf)
    everyone = [None] * world
    dist.all_gather_object(everyone, names)
    assert all(n == names for n in everyone), "ranks yielded different streams"

    # Cast before sending: bf16 out of an fp32 actor.
    for name, tensor in export_hf_weights(actor, dtype=torch.bfloat16, bucket_mb=0.02):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, hf[name].to(torch.bfloat16)), name

    # The reused buffers carry the current weights on the next export, not the previous ones.
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)
    for name, tensor in exporter:
        assert torch.equal(tensor, hf[name] + 1.0), name


@pytest.mark.slow
def test_export_tp2_pp2_many_buckets(tmp_path):
    # qwen2: untied output (VOCAB split), QKV bias, GQA, vocab 301 (padded at TP=2).
    model_dir = make_tiny_model(
        str(tmp_path / "hf"), "qwen2", hidden=64, layers=4, heads=4, kv_heads=2, ffn=96, vocab=301, seed=3
    )
    run_distributed(_body, world_size=4, args=(model_dir,))


def test_merge_shards_into_buffers_equals_fresh():
    """merge_shards(out=views of one flat buffer) == merge_shards() for every split kind."""
    from remax_megatron.models import read_hf_config
    from remax_megatron.weights.mapping import WeightMapping
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        arch = read_hf_config(
            make_tiny_model(d + "/hf", "qwen2", hidden=64, layers=2, heads=8, kv_heads=4, ffn=96, vocab=301, seed=1)
        )
    mapping = WeightMapping(arch, tp=4, pp=1, padded_vocab=304)
    g = torch.Generator().manual_seed(0)
    for spec in mapping.exported_specs():
        shards = [torch.randn(mapping.shard_shape(spec), generator=g) for _ in range(4)]
        fresh = mapping.merge_shards(spec, shards)
        flat = torch.full((sum(t.numel() for _, t in fresh) + 7,), float("nan"))
        out, offset = [], 3
        for _, t in fresh:
            out.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        merged = mapping.merge_shards(spec, shards, out=out)
        assert [n for n, _ in merged] == [n for n, _ in fresh]
        for (name, a), (_, b) in zip(merged, fresh):
            assert torch.equal(a, b), (spec.kind, name)
