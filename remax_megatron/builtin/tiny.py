"""Tiny Hugging Face models of any registered family, offline: random weights and the character tokenizer.

    make_tiny_model("/tmp/tiny-qwen2", "qwen2", hidden=64, layers=4, heads=4, kv_heads=2, ffn=128, vocab=300)
    make_tiny_model("/tmp/tiny-qwen3", "qwen3", hidden=128, heads=4, kv_heads=2, head_dim=64)

The built-in models start from one of these (remax_megatron.builtin.models); tests and benchmarks
make their own shapes (tools/make_tiny_model.py is the command line). Each family's file
(remax_megatron/models/families) says which transformers config it builds and its own options.
"""

from __future__ import annotations

import torch
import transformers

from remax_megatron.builtin.tokenizer import build_tokenizer
from remax_megatron.models import families


def tiny_config(
    family: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int | None = None,
    tie: bool = False,
    reward: bool = False,
    rope_theta: float = 10000.0,
    max_positions: int = 512,
    dtype: str = "float32",
    tools: bool = False,
    **options,
):
    """(HF config, character tokenizer, model class). vocab: total size with filler tokens (None: the
    characters only); tools: the tokenizer's tool-using variant (builtin/tokenizer.py); reward: a
    *ForSequenceClassification with one label (never tied); options: the family's own (e.g. head_dim for
    qwen3 and mistral, sliding_window for mistral)."""
    names = [f.name for f in families.families()]
    if family not in names:
        raise ValueError(f"--family {family!r} is not supported: use one of {', '.join(names)}")
    fam = families.family_named(family)
    tokenizer = build_tokenizer(vocab, tools=tools)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie and not reward,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=dtype,
    )
    config = fam.tiny_config(common, **options)
    if reward:
        config.num_labels = 1
    cls = getattr(transformers, fam.architecture_for(families.REWARD if reward else families.CAUSAL_LM))
    config.architectures = [cls.__name__]
    return config, tokenizer, cls


def make_tiny_model(
    out: str,
    family: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab: int | None = None,
    tie: bool = False,
    reward: bool = False,
    rope_theta: float = 10000.0,
    max_positions: int = 512,
    dtype: str = "float32",
    seed: int = 0,
    overwrite: bool = False,
    **options,
) -> str:
    """Write a random tiny model and its tokenizer into `out`; returns `out`. options: tiny_config's `tools` and
    the family's own."""
    # Here, not at the top: the weights package imports megatron-core, which building a model never needs.
    from remax_megatron.weights.hf_io import holds_checkpoint

    if holds_checkpoint(out) and not overwrite:
        raise FileExistsError(f"{out} already holds a model: choose a new --out or pass --overwrite")
    config, tokenizer, cls = tiny_config(
        family, hidden, layers, heads, kv_heads, ffn, vocab, tie, reward, rope_theta, max_positions, dtype, **options
    )
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype))
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so parity tests see them
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias")):  # gpt-oss: experts' gate_up_proj_bias, ...
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # gpt-oss's sink logits: large enough to take weight from the keys
                p.add_(torch.randn_like(p))
        for name, b in model.named_buffers():  # a DeepSeek-style router's correction bias starts at zero
            if name.endswith("e_score_correction_bias"):  # float32 in any dtype, as published checkpoints keep it
                b.data = b.data.float() + 0.1 * torch.randn(b.shape)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
