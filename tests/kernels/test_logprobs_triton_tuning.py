"""The Triton log-prob kernels' autotuning on a GPU: Hopper-sized configs, a key of shape buckets,
a disk cache; checked here without a GPU (the autotuner is built at import, launches are recorded,
not run). The interpreter keeps its fixed blocks (tests/kernels/triton_interp_checks.py)."""

import os

import pytest
import torch

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":  # the module would build no autotuner
    pytest.skip("checks the GPU (non-interpreter) build of the kernels", allow_module_level=True)


def _tiles(configs):
    return {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_V"], c.kwargs["BLOCK_D"], c.num_warps, c.num_stages) for c in configs}


def test_autotune_configs_include_hopper_tiles():
    import remax_megatron.kernels.logprobs_triton as lt

    tiles = _tiles(lt.AUTOTUNE_CONFIGS)
    assert {(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4)} <= tiles
    assert {stages for *_, stages in tiles} == {3, 4}
    for kernel in (lt._fwd_stats, lt._bwd_dlogits):  # both GEMM kernels are tuned over that list
        assert _tiles(kernel.configs) == tiles
        assert kernel.keys == ["N_BUCKET", "V_BUCKET", "D"]
        assert kernel.cache_results, "the tuned choice must persist across runs (TRITON_CACHE_DIR)"


def test_shape_bucket_is_the_next_power_of_two():
    from remax_megatron.kernels.logprobs_triton import shape_bucket

    assert [shape_bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025, 151936)] == [1, 1, 2, 4, 1024, 1024, 2048, 262144]


class _Recorder:
    """Stands in for an autotuned kernel: records each launch's key arguments."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip(self.kernel.arg_names, args))
            self.calls.append((tuple(named[k] for k in self.kernel.keys), kwargs))

        return launch


def test_token_counts_in_one_bucket_share_one_tuning_key(monkeypatch):
    """1000 and 1023 labelled rows launch with the same key (1024 rows); 1025 tunes anew. No block
    sizes are passed on a GPU: the autotuner chooses them."""
    import remax_megatron.kernels.logprobs_triton as lt

    calls = []
    monkeypatch.setattr(lt, "_fwd_stats", _Recorder(lt._fwd_stats, calls))
    monkeypatch.setattr(lt, "_stat_splits", lambda x, n, v: 1)
    backend = lt.TritonBackend()
    w = torch.zeros(300, 8)
    for n in (1000, 1023, 1025):
        backend.forward_stats(torch.zeros(n, 8), w, torch.zeros(n, dtype=torch.long), 1.0, False)
    keys = [k for k, _ in calls]
    assert keys == [(1024, 512, 8), (1024, 512, 8), (2048, 512, 8)]
    assert all(not {"BLOCK_N", "BLOCK_V", "BLOCK_D"} & set(kw) for _, kw in calls)
