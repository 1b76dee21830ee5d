"""gpt-oss (`model_type: gpt_oss`): the tensor layouts and config pieces that differ from other MoE
families. (The Family subclass and its registration come with the SDPA attention module that gives
megatron sinks and per-layer windows on CPU; until then these are the checked building blocks.)

- Experts are fused 3-D tensors, transposed against nn.Linear: gate_up_proj [E, hidden, 2 * ffn] with
  gate and up interleaved on the last dim (gate = [..., 0::2], up = [..., 1::2]), gate_up_proj_bias
  [E, 2 * ffn] interleaved the same way, down_proj [E, ffn, hidden], down_proj_bias [E, hidden].
  Megatron's expert fc1 is [gate rows; up rows] [2 * ffn, hidden] (its glu chunks in halves), fc2
  [hidden, ffn].
- The activation is (up.clamp(-L, L) + 1) * g * sigmoid(1.702 g) with g = gate.clamp(max=L): megatron's
  quick_gelu (hard-wired 1.702) with glu_linear_offset=1 and activation_func_clamp_value=L.
- `layer_types` sliding_attention keeps keys with q - k < W (transformers' sliding_window_overlay):
  megatron's window (left, right) keeps q - left <= k <= q + right, so W is (W - 1, 0).
"""

from __future__ import annotations

import torch

QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: y * sigmoid(1.702 * y)
SLIDING, FULL = "sliding_attention", "full_attention"


def experts_to_megatron(gate_up, gate_up_bias, down, down_bias):
    """HF fused experts -> per-expert megatron tensors stacked on dim 0:
    fc1 weight [E, 2f, hidden] = [gate; up], fc1 bias [E, 2f], fc2 weight [E, hidden, f], fc2 bias [E, hidden]."""
    fc1 = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1).transpose(1, 2).contiguous()
    fc1_bias = torch.cat((gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]), dim=-1).contiguous()
    return fc1, fc1_bias, down.transpose(1, 2).contiguous(), down_bias.contiguous()


def experts_to_hf(fc1, fc1_bias, fc2, fc2_bias):
    """The inverse of `experts_to_megatron`: re-interleave gate and up, transpose back."""
    ffn = fc1.shape[1] // 2
    gate_up = torch.stack((fc1[:, :ffn], fc1[:, ffn:]), dim=2).flatten(1, 2).transpose(1, 2).contiguous()
    gate_up_bias = torch.stack((fc1_bias[:, :ffn], fc1_bias[:, ffn:]), dim=-1).flatten(-2).contiguous()
    return gate_up, gate_up_bias, fc2.transpose(1, 2).contiguous(), fc2_bias.contiguous()


def activation_kwargs(hf: dict) -> dict:
    """TransformerConfig fields that make megatron's expert MLP compute gpt-oss's activation."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    alpha, limit = hf.get("swiglu_alpha", QUICK_GELU_ALPHA), hf.get("swiglu_limit", 7.0)
    if alpha != QUICK_GELU_ALPHA:
        raise ValueError(
            f"gpt_oss swiglu_alpha={alpha}: megatron's quick_gelu is hard-wired to {QUICK_GELU_ALPHA}; "
            "only checkpoints with that value are supported"
        )
    return dict(
        activation_func=quick_gelu,
        gated_linear_unit=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(limit),
        bias_activation_fusion=False,
        add_bias_linear=True,
    )


def layer_windows(hf: dict) -> list[tuple[int, int] | None]:
    """Megatron's attention window per layer: (W - 1, 0) for sliding layers, None for full ones."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ValueError(
            f"gpt_oss layer_types={types}: expected {layers} entries of {SLIDING!r} / {FULL!r}; fix config.json"
        )
    window = hf.get("sliding_window")
    if SLIDING in types and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"gpt_oss sliding_window={window!r} with sliding layers: set a positive integer")
    return [(window - 1, 0) if t == SLIDING else None for t in types]


# A decoder layer's HF tensors -> megatron-core local-spec parameters (SequentialMLP experts, megatron's
# learnable softmax offset as the sink). q/k/v fuse per query group as in every family; the fused expert
# tensors split per expert through `experts_to_megatron`.
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.k_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.v_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.q_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.k_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.v_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
    "self_attn.sinks": "self_attention.core_attention.softmax_offset",  # [heads], split over TP by head
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    "mlp.experts.gate_up_proj": "mlp.experts.local_experts.{e}.linear_fc1.weight",
    "mlp.experts.gate_up_proj_bias": "mlp.experts.local_experts.{e}.linear_fc1.bias",
    "mlp.experts.down_proj": "mlp.experts.local_experts.{e}.linear_fc2.weight",
    "mlp.experts.down_proj_bias": "mlp.experts.local_experts.{e}.linear_fc2.bias",
}


def yarn_kwargs(hf: dict) -> dict:
    """megatron-core YarnRotaryEmbedding arguments for gpt-oss's YaRN (`rope_scaling` or transformers 5's
    `rope_parameters`); transformers' `truncate` is megatron's `correction_range_round_to_int`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "yarn":
        raise ValueError(f"gpt_oss rope {rope!r}: only YaRN (rope_type 'yarn') is supported; fix config.json")
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(key) is not None:
            raise ValueError(f"gpt_oss YaRN {key}={rope[key]}: not supported (gpt-oss leaves it unset)")
    return dict(
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        scaling_factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        correction_range_round_to_int=bool(rope.get("truncate", True)),
    )
