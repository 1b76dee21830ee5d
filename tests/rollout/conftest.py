"""Fixtures for the rollout tests: a tiny Llama and tiny MoE models (Qwen3-MoE, Mixtral, DeepSeek-V3), char
tokenizer."""

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
        # MLA with the latent width vLLM's CPU kernel runs (512 + 64), a q latent (vLLM fuses q_a with kv_a),
        # YaRN, a dense first layer, a shared expert, group-limited sigmoid routing (2 groups, 1 kept); experts 64
        # wide: 32 on each rank of a rollout.tp=2 engine (vLLM's CPU experts need multiples of 32 per rank)
        "deepseek_v3": make_tiny_model(
            str(root / "deepseek_v3"),
            "deepseek_v3",
            hidden=64,
            layers=2,
            heads=2,
            kv_heads=2,
            ffn=64,
            moe_ffn=64,
            experts=4,
            top_k=2,
            q_lora_rank=48,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            groups=2,
            group_topk=1,
            yarn=True,
            seed=16,
        ),
    }
