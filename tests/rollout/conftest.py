"""Fixtures for the rollout tests: a tiny Llama with a char tokenizer."""

import pytest

from tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Llama, tied embeddings, GQA 4/2 heads of 32 (a head size vLLM's CPU backend runs), vocab 101 (chars),
    2 layers."""
    return make_tiny_model(str(tmp_path_factory.mktemp("rollout") / "llama"), "llama", hidden=128, layers=2,
                           heads=4, kv_heads=2, ffn=96, tie=True, seed=5)
