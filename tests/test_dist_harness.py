"""tests/_dist.py's start of ranks: CUDA ranks are spawned (a rank forked from the fork server cannot initialise
CUDA once the server's imports asked the CUDA runtime anything), CPU ranks keep the warm fork server.

On a GPU machine three of five multi-process GPU tests died at `torch.cuda.set_device` with "Cannot
re-initialize CUDA in forked subprocess": megatron-core's dist_checkpointing/strategies/torch.py calls
`torch.cuda.is_available()` at import (reached through PRELOAD's remax_megatron.weights), and that call
(cudaGetDeviceCount) poisons every later fork of the process.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tests._dist as harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a fork-server import could call that leaves the server unable to fork a CUDA rank: the CUDA runtime's
# device count (is_available, device_count without NVML) and CUDA's initialisation itself.
_PROBE = textwrap.dedent(
    """
    import json, sys, traceback
    import torch, torch.cuda
    calls = []
    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
                 "get_device_capability", "get_device_properties", "get_device_name", "synchronize",
                 "is_bf16_supported", "mem_get_info"):
        def wrapped(*a, _name=name, _orig=getattr(torch.cuda, name), **k):
            calls.append([_name, traceback.format_stack(limit=4)[0].strip()])
            return _orig(*a, **k)
        setattr(torch.cuda, name, wrapped)
    exec(sys.argv[1])
    print(json.dumps(calls))
    """
)


def _cuda_calls(code: str) -> list:
    """The CUDA queries `code` makes, run in a fresh interpreter with the queries recorded."""
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "available,device,method",
    [
        (True, None, "spawn"),
        (True, "cuda", "spawn"),
        (True, "cpu", "forkserver"),
        (False, None, "forkserver"),
        (False, "cpu", "forkserver"),
        (False, "cuda", "spawn"),
    ],
)
def test_cuda_ranks_are_spawned_and_cpu_ranks_forked_from_the_warm_server(monkeypatch, available, device, method):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    cuda = harness.cuda_workers(device)
    assert cuda == (device == "cuda" or (device is None and available))
    ctx = harness._context(cuda)
    assert ctx.get_start_method() == method
    assert harness._context().get_start_method() == harness.start_method(available)


def test_an_unknown_device_request_is_refused():
    with pytest.raises(ValueError, match="'gpu'"):
        harness.cuda_workers("gpu")


def _spawned_body(rank, world_size, out):
    # a fresh interpreter: nothing imported before this rank's own start touched CUDA or forked it
    assert not torch.cuda.is_initialized() and not torch.cuda._is_in_bad_fork()
    assert os.environ["RANK"] == str(rank) and torch.distributed.get_backend() == "gloo"
    with open(out, "w") as f:
        f.write(torch.multiprocessing.get_start_method())


@pytest.mark.slow
def test_a_spawned_rank_runs_the_body(monkeypatch, tmp_path):
    # the CUDA ranks' start method, run on CPU: pickled body, environment, gloo group, error queue
    monkeypatch.setattr(harness, "start_method", lambda cuda: "spawn")
    out = tmp_path / "method"
    harness.run_distributed(_spawned_body, world_size=1, args=(str(out),), device="cpu")
    assert out.read_text() == "spawn"


@pytest.mark.slow
def test_the_probe_sees_an_import_time_cuda_query_and_the_rank_start_makes_none():
    # the probe works: a module-level is_available() (as megatron-core's strategies/torch.py has) is seen
    assert [c[0] for c in _cuda_calls("import torch; torch.cuda.is_available()")] == ["is_available"]
    # what a CUDA rank's process runs before its own set_device: the harness module, torch.distributed
    assert _cuda_calls("import tests._dist, torch.distributed") == []
