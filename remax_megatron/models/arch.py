"""The architecture facts remax-megatron reads from a Hugging Face config (names follow megatron).

A leaf module (no megatron-core import): the weight mapping, the planner and the model-family
registry all describe a model by a ModelArch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelArch:
    """What remax-megatron reads from an HF config (names follow megatron)."""

    architecture: str          # e.g. "Qwen2ForCausalLM"
    family: str                # the registered model family (models/families), e.g. "qwen3"
    task: str                  # "causal_lm" | "reward"
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int            # the tokenizer's vocab; megatron pads it for TP
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, None for plain RoPE
    tie_word_embeddings: bool
    max_position_embeddings: int
    pad_token_id: int | None
    torch_dtype: str
    # Family features (models/families/<family>.py sets them)
    qkv_bias: bool = False             # biases on q, k, v (Qwen2)
    qk_layernorm: bool = False         # RMSNorm over each head's queries and keys (Qwen3)
    sliding_window: int | None = None  # attention window of some layer; None: full attention everywhere
