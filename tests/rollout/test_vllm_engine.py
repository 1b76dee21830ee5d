"""The vLLM engine's pure parts on CPU: request building, output parsing, and the engine's calls
into a stand-in `LLM` (one generate per call, weight buckets through collective_rpc, prefix-cache
reset, sleep levels). With vLLM importable, request building also runs on the real SamplingParams."""

from types import SimpleNamespace

import pytest
import torch

from remax_megatron.config import RolloutConfig
from remax_megatron.rollout import SamplingParams, sync_weights
from remax_megatron.rollout.vllm_engine import VllmEngine, build_requests, null_config_context, parse_outputs
from tests.rollout.helpers import hf_stream


class StubParams:
    """Records the keywords a vllm.SamplingParams would get."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16, stop=["\n\n"], seed=None)


def _check_requests(prompts, params, n):
    assert len(prompts) == len(params) == 4
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2], [1, 2], [3], [3]]
    sampled, greedy = params[0], params[1]
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.top_k) == (n, 0.7, 0.9, 20)
    assert sampled.max_tokens == 16 and list(sampled.stop) == ["\n\n"] and sampled.logprobs == 0
    assert greedy.n == 1 and greedy.temperature == 0.0 and greedy.max_tokens == 16 and greedy.logprobs == 0
    assert params[0].seed == 100 and params[2].seed == 100 + n


def test_build_requests_pairs_sampled_and_greedy():
    prompts, params = build_requests([[1, 2], [3]], 3, SAMPLING, seed=100, params_cls=StubParams)
    _check_requests(prompts, params, 3)


def test_build_requests_with_real_vllm_sampling_params():
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (GPU extra); its request types are "
                                              "checked where it imports")
    prompts, params = build_requests([[1, 2], [3]], 3, SAMPLING, seed=100, params_cls=vllm.SamplingParams)
    _check_requests(prompts, params, 3)
    # vLLM's own greedy normalisation: temperature 0 turns top-k / top-p off.
    assert params[1].top_k == 0 and params[1].top_p == 1.0
    assert params[0].include_stop_str_in_output


def test_greedy_only_requests_have_no_sampled_entry():
    """Eval asks for n = 0: vLLM refuses SamplingParams(n=0), so only the greedy entries go out."""
    prompts, params = build_requests([[1, 2], [3]], 0, SAMPLING, seed=100, params_cls=StubParams)
    assert [p["prompt_token_ids"] for p in prompts] == [[1, 2], [3]]
    assert all(q.n == 1 and q.temperature == 0.0 for q in params)
    outputs = [SimpleNamespace(outputs=[_output([8, 9])]), SimpleNamespace(outputs=[_output([7])])]
    rollouts = parse_outputs(outputs, 0)
    assert [r.sampled for r in rollouts] == [[], []]
    assert [r.greedy.token_ids for r in rollouts] == [[8, 9], [7]]


def _output(token_ids, index=0, reason="length"):
    logprobs = [{t: SimpleNamespace(logprob=-0.1 * (i + 1))} for i, t in enumerate(token_ids)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


def test_parse_outputs():
    outputs = [SimpleNamespace(outputs=[_output([5, 6], 1), _output([7], 0, "stop")]),
               SimpleNamespace(outputs=[_output([8, 9, 10])])]
    (ro,) = parse_outputs(outputs, 2)
    assert [c.token_ids for c in ro.sampled] == [[7], [5, 6]] and ro.sampled[0].finish_reason == "stop"
    assert ro.greedy.token_ids == [8, 9, 10] and ro.greedy.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    with pytest.raises(RuntimeError, match="expected 3 / 1"):
        parse_outputs(outputs, 3)
    outputs[1].outputs[0].finish_reason = "abort"
    with pytest.raises(RuntimeError, match="reason 'abort'"):
        parse_outputs(outputs, 2)


class FakeLLM:
    """Stands in for vllm.LLM: records calls; its 'worker' records the weight names it loads."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        model = SimpleNamespace(load_weights=lambda weights: self.loaded.append([n for n, _ in weights]))
        self.worker = SimpleNamespace(vllm_config=None, get_model=lambda: model)

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        outs = []
        for i, p in enumerate(params):
            outs.append(SimpleNamespace(outputs=[_output([4 + i, 2], j, "stop") for j in range(p.n)]))
        return outs

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc",))
        return [method(self.worker, *args)]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def _engine(tiny_llama):
    return VllmEngine(RolloutConfig(engine="vllm", gpu_memory_utilization=0.3), hf_dir=tiny_llama, seed=1,
                      dtype=torch.bfloat16, llm_factory=FakeLLM,
                      vllm_classes=lambda: (StubParams, null_config_context))


def test_llm_is_created_for_the_external_launcher(tiny_llama):
    llm = _engine(tiny_llama).llm
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["tensor_parallel_size"] == 1 and llm.kwargs["dtype"] == "bfloat16"
    assert llm.kwargs["gpu_memory_utilization"] == 0.3 and llm.kwargs["model"] == tiny_llama


def test_weight_stream_generate_and_sleep(tiny_llama):
    engine = _engine(tiny_llama)
    with pytest.raises(RuntimeError, match="without valid weights"):
        engine.generate([[1, 2]], n=2, sampling=SAMPLING)
    stats = sync_weights(engine, hf_stream(tiny_llama), bucket_mb=0.05)
    llm = engine.llm
    # HF names reach the model's load_weights unchanged, in export order, one call per bucket.
    names = [n for bucket in llm.loaded for n in bucket]
    assert names == [n for n, _ in hf_stream(tiny_llama)]
    assert len(llm.loaded) == stats["buckets"] > 1
    assert llm.calls[-1] == ("reset_prefix_cache",)
    llm.calls.clear()
    out = engine.generate([[1, 2], [3]], n=2, sampling=SAMPLING)
    assert llm.calls == [("generate", 4)] and engine.num_requests == 1
    assert len(out) == 2 and all(len(ro.sampled) == 2 for ro in out)
    engine.sleep()
    assert llm.calls[-1] == ("sleep", 2)
    with pytest.raises(RuntimeError, match="without valid weights"):
        engine.generate([[1]], n=1, sampling=SAMPLING)
    llm.calls.clear()
    sync_weights(engine, hf_stream(tiny_llama), bucket_mb=1)
    engine.generate([[1]], n=1, sampling=SAMPLING)
    wakes = [c for c in llm.calls if c[0] == "wake_up"]
    assert wakes == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
