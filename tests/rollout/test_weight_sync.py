"""Bucketed weight sync: bucket packing, dtype cast, one load call per bucket, engine == HF model."""

import pytest
import torch

from remax_megatron.rollout import RolloutEngine, sync_weights
from remax_megatron.rollout.weight_sync import BucketPacker
from tests.rollout.helpers import hf_stream


class RecordingEngine(RolloutEngine):
    """Keeps a copy of every bucket it is handed."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.dtype, self.device = dtype, torch.device("cpu")
        self.buckets, self.events = [], []

    def update_weights(self, buckets):
        self.events.append("begin")
        for named_tensors in buckets:
            self.events.append("load")
            self.buckets.append([(name, t.clone(), t.untyped_storage().data_ptr()) for name, t in named_tensors])
        self.events.append("finish")


def _stream():
    g = torch.Generator().manual_seed(0)
    shapes = [("a", (300,)), ("b", (64, 64)), ("c", (10,)), ("huge", (600, 300)), ("d", (5, 7))]
    return [(name, torch.randn(shape, generator=g)) for name, shape in shapes]


def test_buckets_are_contiguous_and_complete():
    tensors = _stream()
    engine = RecordingEngine()
    stats = sync_weights(engine, iter(tensors), bucket_mb=40_000 / 2**20)  # 40 kB buckets
    assert engine.events[0] == "begin" and engine.events[-1] == "finish"
    assert stats["buckets"] == len(engine.buckets) == engine.events.count("load")
    got = [(name, t) for bucket in engine.buckets for name, t, _ in bucket]
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, ref), (_, t) in zip(tensors, got):
        assert torch.equal(ref, t)
    assert stats["bytes"] == sum(t.numel() * 4 for _, t in tensors)
    # a (1.2 kB) + b (16 kB) share a bucket; the 720 kB tensor goes alone.
    names = [[n for n, _, _ in bucket] for bucket in engine.buckets]
    assert names[0] == ["a", "b", "c"] and ["huge"] in names
    # Every tensor of a bucket is a view into one buffer.
    for bucket in engine.buckets:
        assert len({ptr for _, _, ptr in bucket}) == 1


def test_cast_to_engine_dtype():
    engine = RecordingEngine(dtype=torch.bfloat16)
    tensors = _stream()
    stats = sync_weights(engine, iter(tensors), bucket_mb=1)
    assert stats["buckets"] == 1
    for (_, ref), (_, t, _) in zip(tensors, engine.buckets[0]):
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref.to(torch.bfloat16))
    assert stats["bytes"] == sum(t.numel() * 2 for _, t in tensors)


def test_packer_reuses_its_buffer():
    packer = BucketPacker(4096, torch.float32, torch.device("cpu"))
    source = torch.empty(300)  # one reused source buffer, like the export's
    ready, values = [], []
    for i in range(8):
        if not packer.fits(source):
            ready.append(packer.take())
            values.append([float(t[0]) for _, t in ready[-1]])  # read before the next put reuses the buffer
        packer.put(f"t{i}", source.fill_(float(i)))
    assert len(ready) >= 2
    assert len({b[0][1].untyped_storage().data_ptr() for b in ready}) == 1
    # Each tensor was copied when put: later fills of the source did not change it.
    assert [v for vs in values for v in vs] == [float(i) for i in range(sum(map(len, values)))]


@pytest.mark.parametrize("bad", [0, -1])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match=f"rollout.sync_bucket_mb={bad}"):
        sync_weights(RecordingEngine(), iter(_stream()), bucket_mb=bad)


def test_native_engine_after_sync_equals_transformers(tiny_llama):
    from transformers import AutoModelForCausalLM

    from remax_megatron.rollout.native import NativeEngine

    engine = NativeEngine(hf_dir=tiny_llama, device="cpu")
    stats = sync_weights(engine, hf_stream(tiny_llama), bucket_mb=0.05)
    assert stats["buckets"] > 1 and stats["seconds"] > 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, hf(ids).logits)


def test_incomplete_or_foreign_stream_is_refused(tiny_llama):
    from remax_megatron.rollout.native import NativeEngine

    engine = NativeEngine(hf_dir=tiny_llama, device="cpu")
    partial = [(n, t) for n, t in hf_stream(tiny_llama) if n != "model.norm.weight"]
    with pytest.raises(ValueError, match="left 1 engine parameters unset"):
        sync_weights(engine, iter(partial), bucket_mb=1)
    with pytest.raises(ValueError, match="'lm_head.bias' has no parameter"):
        sync_weights(engine, iter([("lm_head.bias", torch.zeros(3))]), bucket_mb=1)
    with pytest.raises(ValueError, match="shape \\(3,\\) but the engine has"):
        sync_weights(engine, iter([("model.norm.weight", torch.zeros(3))]), bucket_mb=1)


def _in_place_body(rank, world, model_dirs):
    from remax_megatron.models import build_policy, read_hf_config
    from remax_megatron.parallel import ParallelLayout
    from remax_megatron.rollout import WeightSync
    from remax_megatron.rollout.native import NativeEngine
    from remax_megatron.weights import export_hf_weights, load_hf_weights

    groups = ParallelLayout(tp=1, pp=1, world_size=world).initialize(seed=0)
    for model_dir in model_dirs:
        actor = build_policy(read_hf_config(model_dir), tp=1, pp=1, trainable=False)
        load_hf_weights(actor, model_dir)
        for dtype in (torch.float32, torch.bfloat16):
            direct = NativeEngine(hf_dir=model_dir, dtype=dtype, device="cpu")
            staged = NativeEngine(hf_dir=model_dir, dtype=dtype, device="cpu")
            sync = WeightSync(direct, actor, bucket_mb=0.02, groups=groups)
            for step in range(2):  # the second sync after an update: no stale weights in place either
                stats = sync()
                sync_weights(staged, export_hf_weights(actor, dtype=dtype, bucket_mb=0.02), bucket_mb=0.02)
                tensors = sum(1 for _ in export_hf_weights(actor, bucket_mb=0.02))
                assert stats["buckets"] > 1
                # every tensor written by the export into the engine's own storage; nothing staged
                assert direct.last_update == {"in_place": tensors, "copied": 0}, (model_dir, direct.last_update)
                assert staged.last_update["in_place"] == 0
                for name, p in direct.model.named_parameters():
                    q = staged.model.get_parameter(name)
                    assert p.dtype == dtype and torch.equal(p, q), (model_dir, dtype, step, name)
                with torch.no_grad():
                    for p in actor.parameters():
                        p.add_(0.01 * torch.randn_like(p))


def test_colocated_sync_writes_in_place_bit_for_bit(tiny_llama, tmp_path):
    """tp1, one device: WeightSync writes the export straight into the native engine's parameters (no staged
    copy), and the engine's weights equal those of the staged path (packer + copy) bit for bit, in fp32 and
    bf16, for a tied Llama and an untied Qwen2 with QKV bias."""
    from tests._dist import run_distributed
    from tools.make_tiny_model import make_tiny_model

    qwen2 = make_tiny_model(
        str(tmp_path / "qwen2"), "qwen2", hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=301, seed=3
    )
    run_distributed(_in_place_body, world_size=1, args=([tiny_llama, qwen2],))
