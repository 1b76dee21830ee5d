"""The native engine's decode loop on CUDA (rollout/native_decode.py; collected only with CUDA):

- between two host checks the decode never synchronises with the host (torch.cuda.set_sync_debug_mode
  "error" around every decode step), dense and MoE (transformers' grouped-mm experts);
- the CUDA graph replays what the eager step computes (tokens equal, fp32 log-probs within 1e-6), and a
  sleep() / wake_up() between requests (weights moved off the GPU and back) still gives the same rows;
- greedy rows equal the old loop's (tests/rollout/_reference_decode.py) token for token on the GPU.
"""

import pytest
import torch

from remax_megatron.rollout import SamplingParams, sync_weights
from remax_megatron.rollout import native_decode
from tests.rollout.helpers import hf_stream
from tools.make_tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")

PROMPTS = [[5, 17, 40, 41, 42], [9, 10], [60, 61, 62, 63, 64, 65, 66, 67], [3]]
SEEDS = [101, 202, 303, 404]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("native-cuda")
    common = dict(hidden=128, layers=2, heads=4, kv_heads=2)
    return {
        "llama": make_tiny_model(str(root / "llama"), "llama", ffn=96, tie=True, seed=5, **common),
        "qwen3_moe": make_tiny_model(str(root / "moe"), "qwen3_moe", ffn=64, experts=4, top_k=2, seed=14, **common),
    }


def _engine(model_dir, dtype=torch.float32):
    from remax_megatron.rollout.native import NativeEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    engine = NativeEngine(hf_dir=model_dir, seed=0, dtype=dtype, device="cuda")
    sync_weights(engine, ((n, t.to("cuda", dtype)) for n, t in hf_stream(model_dir)), bucket_mb=1)
    engine.eos_token_ids = set()  # random weights: rows run to their limit
    return engine


def _rows(out):
    return [c for ro in out for c in ro.sampled + [ro.greedy]]


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("qwen3_moe", torch.bfloat16)])
def test_no_host_sync_between_two_checks(family, dtype, models, monkeypatch):
    engine = _engine(models[family], dtype)
    if family != "llama":
        assert engine.model.config._experts_implementation != "eager"
    steps, captures = [], []
    step, capture = native_decode.WaveDecoder.decode_step, native_decode.WaveDecoder._capture

    def strict_step(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        steps.append(self.graph is not None)

    def counted_capture(self):
        capture(self)
        captures.append(1)

    monkeypatch.setattr(native_decode.WaveDecoder, "decode_step", strict_step)
    monkeypatch.setattr(native_decode.WaveDecoder, "_capture", counted_capture)
    out = engine.generate(PROMPTS, n=3, sampling=SamplingParams(max_new_tokens=40, temperature=0.9), seeds=SEEDS)
    assert all(len(c.token_ids) == 40 for c in _rows(out))
    assert len(steps) == 39 and sum(steps) >= 30 and captures == [1], (sum(steps), captures)


def test_cuda_graph_equals_eager_and_survives_sleep(models, monkeypatch):
    engine = _engine(models["llama"])
    sampling = SamplingParams(max_new_tokens=32, temperature=0.8, top_k=20, top_p=0.95, stop_token_ids=[40, 41])
    graph = _rows(engine.generate(PROMPTS, n=3, sampling=sampling, seeds=SEEDS))
    engine.sleep()
    engine.wake_up()
    again = _rows(engine.generate(PROMPTS, n=3, sampling=sampling, seeds=SEEDS))
    monkeypatch.setattr(native_decode, "CUDA_GRAPHS", False)
    eager = _rows(engine.generate(PROMPTS, n=3, sampling=sampling, seeds=SEEDS))
    for a, b, c in zip(graph, again, eager):
        assert a.token_ids == b.token_ids == c.token_ids and a.finish_reason == c.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs)) < 1e-6
    assert len({len(c.token_ids) for c in graph}) > 1, "no row ended early: the stop ids cut nothing"


def test_greedy_rows_equal_the_old_loop_on_cuda(models):
    from tests.rollout._reference_decode import reference_decode

    engine = _engine(models["llama"])
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    new = engine.generate(PROMPTS, n=1, sampling=sampling, seeds=SEEDS)
    generators = [g for s in SEEDS for g in (torch.Generator(device="cuda").manual_seed(s), None)]
    old = reference_decode(engine, PROMPTS, 2, [False, True] * len(PROMPTS), generators, sampling, [24] * 8)
    for p, ro in enumerate(new):
        assert ro.greedy.token_ids == old[2 * p + 1].token_ids
        assert max(abs(x - y) for x, y in zip(ro.greedy.logprobs, old[2 * p + 1].logprobs)) < 1e-5
