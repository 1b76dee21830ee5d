"""The Triton kernels pass the parity checks on CPU under TRITON_INTERPRET=1.

The interpreter is chosen when ``@triton.jit`` runs, so the checks run in a
fresh subprocess with the env var set (this process may have imported the
kernels already); each check is reported as its own test.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def results():
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.pop("REMAX_KERNEL_IMPL", None)
    out = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_interp_checks"],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _names():
    from tests.kernels.cases import CASES

    names = [f"logprobs_fp32_{c}_chunk{k}{hint}" for c in sorted(CASES) for k in (None, 32) for hint in ("", "_hint")]
    names += ["logprobs_fp64_basic", "logprobs_fp64_hint"]
    names += [f"logprobs_bf16_{c}{hint}" for c in ("basic", "ignored_rows") for hint in ("", "_hint")]
    names += [f"logprobs_hint_{w}_recomputes" for w in ("not_a_multiple", "entropy_grad")]
    names += ["logprobs_gemm_passes_hint3_plain4", "logprobs_interpreter_fixed_blocks"]
    names += [
        f"advantages_kl{a}_clip{b}_block{c}"
        for a, b, c in ((0.0, None, 16), (0.1, None, 4), (0.3, 0.5, 4), (0.1, None, 16))
    ]
    return names


@pytest.mark.parametrize("name", _names())
def test_triton_interpreter(results, name):
    assert name in results, f"check {name} did not run"
    assert results[name] == "ok", results[name]


def test_no_check_left_unreported(results):
    assert sorted(results) == sorted(_names())
