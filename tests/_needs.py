"""What a test needs that an install may lack.

The main CI lane installs vLLM's CPU build, and a test of the vLLM engine that finds no vLLM there fails. The
Python 3.12 lane (.ci/run_py312: megatron-core 0.19, PyPI's torch; no vLLM wheel for that torch) sets
REMAX_TESTS_WITHOUT_VLLM=1 and runs the native engine: there, and only while vLLM is really absent, tests of
the vLLM engine skip, and tests of other checks run on the native engine (`engine_overrides`)."""

import importlib.util
import os

import pytest

WITHOUT_VLLM = os.environ.get("REMAX_TESTS_WITHOUT_VLLM") == "1" and importlib.util.find_spec("vllm") is None
needs_vllm = pytest.mark.skipif(
    WITHOUT_VLLM,
    reason="vLLM is not installed (REMAX_TESTS_WITHOUT_VLLM=1: the Python 3.12 lane runs the native engine)",
)


def engine_overrides() -> list[str]:
    """Config overrides for a test of something other than the engine: the default (vLLM) engine, or the
    native one in the lane without vLLM."""
    return ["rollout.engine=native"] if WITHOUT_VLLM else []
