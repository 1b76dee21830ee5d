"""tools/bench_routing_replay.py, part 1, on a tiny random Qwen3-MoE (16 experts, 4 per token): in fp32 the
native engine routes every fed token where the megatron actor does and replay changes nothing; in bf16 some
token-layers go to other experts (transformers and megatron round differently) and replaying the engine's
routes lowers the log-prob gap. A numerics property of the same sequences scored both ways, not a timing."""

import pytest

from tests._dist import run_distributed
from tools.make_tiny_model import make_tiny_model


def _body(rank, world, model_dir, out):
    import json

    from tools.bench_routing_replay import controlled

    results = [controlled(model_dir, d, prompts=8, n=4, max_new_tokens=24, seed=0) for d in ("float32", "bfloat16")]
    with open(out, "w") as f:
        json.dump(results, f)


@pytest.mark.slow
def test_replay_lowers_the_bf16_gap_and_changes_nothing_in_fp32(tmp_path):
    import json

    model_dir = make_tiny_model(
        str(tmp_path / "moe"),
        "qwen3_moe",
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn=128,
        experts=16,
        top_k=4,
        seed=3,
    )
    out = str(tmp_path / "result.json")
    run_distributed(_body, world_size=1, args=(model_dir, out))
    fp32, bf16 = json.load(open(out))
    assert fp32["route_mismatch_frac"] == 0.0 and fp32["gap_max_no_replay"] < 1e-5, fp32
    assert fp32["gap_max_replay"] == fp32["gap_max_no_replay"], fp32
    assert bf16["route_mismatch_frac"] > 0.0, bf16  # measured 0.025 at 16 prompts x 32 tokens
    assert bf16["gap_max_replay"] < bf16["gap_max_no_replay"], bf16  # measured 0.009 vs 0.034
    assert bf16["gap_mean_replay"] < bf16["gap_mean_no_replay"], bf16
