"""The native engine's weight update on CUDA: a sleeping engine is woken with fresh parameter storage (no upload
of its stale CPU copy) and ends with exactly the synced weights, on the device, buffers included; the in-place
path (weight_destination) on the device."""

import torch

from remax_megatron.rollout import sync_weights
from remax_megatron.rollout.native import NativeEngine
from tests.rollout.helpers import hf_stream
from tools.make_tiny_model import make_tiny_model


def test_a_sleeping_engine_takes_fresh_storage_and_the_synced_weights(tmp_path):
    model_dir = make_tiny_model(str(tmp_path / "llama"), "llama", hidden=128, layers=2, heads=4, kv_heads=2, ffn=96)
    awake = NativeEngine(hf_dir=model_dir, device="cuda", dtype=torch.bfloat16)
    sync_weights(awake, hf_stream(model_dir), bucket_mb=0.05)
    slept = NativeEngine(hf_dir=model_dir, device="cuda", dtype=torch.bfloat16)
    sync_weights(slept, hf_stream(model_dir, scale_final_norm=3.0), bucket_mb=0.05)  # other weights first
    slept.sleep()
    assert all(p.device.type == "cpu" for p in slept.model.parameters())
    sync_weights(slept, hf_stream(model_dir), bucket_mb=0.05)
    assert not slept.asleep and all(b.device.type == "cuda" for b in slept.model.buffers())
    for name, p in slept.model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p, awake.model.get_parameter(name)), name
    # In place: a bucket made of the engine's own parameters (as the colocated export yields) copies nothing.
    own = [(name, slept.weight_destination(name)) for name, _ in hf_stream(model_dir)]
    slept.update_weights([[(n, t) for n, t in own if t is not None]])
    assert slept.last_update["copied"] == 0 and slept.last_update["in_place"] == len(own)
