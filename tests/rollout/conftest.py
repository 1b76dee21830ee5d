"""Fixtures for the rollout tests: a tiny Llama and tiny MoE models (Qwen3-MoE, Mixtral), char tokenizer."""

import pytest

from tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Llama, tied embeddings, GQA 4/2 heads of 32 (a head size vLLM's CPU backend runs), vocab 101 (chars),
    2 layers."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("rollout") / "llama"),
        "llama",
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=96,
        tie=True,
        seed=5,
    )


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    """Qwen3-MoE and Mixtral: 4 experts, 2 per token, 2 layers, heads of 32 (vLLM's CPU backend runs them)."""
    root = tmp_path_factory.mktemp("moe")
    return {
        "qwen3_moe": make_tiny_model(
            str(root / "qwen3_moe"),
            "qwen3_moe",
            hidden=128,
            layers=2,
            heads=4,
            kv_heads=2,
            ffn=64,
            experts=4,
            top_k=2,
            seed=14,
        ),
        "mixtral": make_tiny_model(
            str(root / "mixtral"),
            "mixtral",
            hidden=128,
            layers=2,
            heads=4,
            kv_heads=2,
            ffn=64,
            experts=4,
            top_k=2,
            seed=15,
        ),
    }
