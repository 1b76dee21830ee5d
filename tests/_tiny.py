"""The small random models that the update, LoRA and step tests build: 2 layers of hidden 64, GQA 4 heads /
2 kv heads (MoE: 4 experts of width 32, 2 per token, vocab 128)."""

from tools.make_tiny_model import make_tiny_model

SMALL_DENSE = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96)
SMALL_MOE = dict(SMALL_DENSE, ffn=32, vocab=128, experts=4, top_k=2)


def small_model(tmp_path_factory, family: str, seed: int, **options) -> str:
    """A fresh HF directory of `family` in the small shape (MoE families: SMALL_MOE); options override it."""
    shape = SMALL_MOE if family in ("qwen3_moe", "mixtral") else SMALL_DENSE
    return make_tiny_model(str(tmp_path_factory.mktemp(family) / family), family, seed=seed, **{**shape, **options})
