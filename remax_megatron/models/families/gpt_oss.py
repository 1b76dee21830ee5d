"""gpt-oss (`model_type: gpt_oss`, GptOssForCausalLM): grouped-query attention with biases on q, k, v and
o_proj, a learned per-head sink logit (`self_attn.sinks`: one more softmax column with no value; megatron's
softmax_type "learnable", its `softmax_offset`, run by models/attention.py), sliding-window and full layers
alternating as `layer_types` says, YaRN RoPE, and every MLP routed: a router with a bias (top-k of the
logits, softmax over the k), experts with biases and gpt-oss's clamped SwiGLU. The experts run as
megatron's SequentialMLP (its GroupedMLP / TEGroupedMLP take no quick_gelu with glu_linear_offset).

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

import re

import torch

from remax_megatron.models.families.base import (
    CAUSAL_LM,
    COLUMN,
    FC1,
    REPLICATED,
    ROW,
    EngineTensor,
    Family,
    MoeNames,
    TensorRule,
    attention_rules,
)

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


# ---- the checkpoint's fused experts, seen per expert ---------------------------------------------------------
# The weight mapping (weights/mapping.py) moves one HF tensor per expert matrix, as every other MoE family's
# checkpoint stores them. gpt-oss stores each layer's experts fused ([E, ...], gate and up interleaved, the
# matrices transposed): the reader shows them as these per-expert names (views of one expert's slice,
# `expert_view`), the HF writer fuses them back (`fuse_experts`), and the native engine writes them into
# transformers' fused parameters through the same views. The names exist in no gpt-oss checkpoint.
EXPERT = "mlp.experts.{}."
# per-expert (projection, weight | bias) -> (the fused tensor after "mlp.experts.", which half of its last dim:
# 0 gate, 1 up, None all); weights are nn.Linear's [out, in], the transpose of the fused layout
PARTS = {
    ("gate_proj", "weight"): ("gate_up_proj", 0),
    ("up_proj", "weight"): ("gate_up_proj", 1),
    ("down_proj", "weight"): ("down_proj", None),
    ("gate_proj", "bias"): ("gate_up_proj_bias", 0),
    ("up_proj", "bias"): ("gate_up_proj_bias", 1),
    ("down_proj", "bias"): ("down_proj_bias", None),
}
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*mlp\.experts\.)(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)$"
)
_FUSED = re.compile(r"^(?P<prefix>.*mlp\.experts\.)(?P<fused>gate_up_proj|down_proj)(?P<bias>_bias)?$")


def expert_view(fused_expert: torch.Tensor, half: int | None) -> torch.Tensor:
    """One expert's slice of a fused tensor ([hidden, 2f], [2f], [f, hidden] or [hidden]) -> its per-expert
    tensor as a view: the gate / up half de-interleaved, a matrix transposed to nn.Linear's [out, in]."""
    part = fused_expert if half is None else fused_expert[..., half::2]
    return part.t() if part.dim() == 2 else part


def split_expert_name(name: str) -> tuple[str, int, int | None] | None:
    """A per-expert name -> (the fused checkpoint tensor, expert, half); None for any other name."""
    found = _PER_EXPERT.match(name)
    if found is None:
        return None
    fused, half = PARTS[(found.group("proj"), found.group("kind"))]
    return found.group("prefix") + fused, int(found.group("expert")), half


def per_expert_names(fused_name: str, experts: int) -> list[str]:
    """The per-expert names a fused checkpoint tensor shows as ([] for a name that is not one)."""
    found = _FUSED.match(fused_name)
    if found is None:
        return []
    fused = found.group("fused") + (found.group("bias") or "")
    parts = [(proj, kind) for (proj, kind), (f, _) in PARTS.items() if f == fused]
    return [f"{found.group('prefix')}{e}.{proj}.{kind}" for e in range(experts) for proj, kind in parts]


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (every expert of each fused tensor they belong to) -> the fused checkpoint tensors."""
    groups: dict[str, dict[tuple[int, int | None], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        fused, expert, half = split_expert_name(name)
        groups.setdefault(fused, {})[(expert, half)] = tensor
    out = {}
    for fused, parts in groups.items():
        experts = 1 + max(e for e, _ in parts)
        halves = sorted({h for _, h in parts}, key=lambda h: -1 if h is None else h)
        if len(parts) != experts * len(halves):
            raise ValueError(f"{fused}: got {len(parts)} per-expert tensors, expected {experts * len(halves)}")
        first = parts[(0, halves[0])]
        shape = first.shape[::-1] if first.dim() == 2 else first.shape  # the fused [in, out] of one half
        if halves != [None]:
            shape = (*shape[:-1], 2 * shape[-1])
        whole = torch.empty((experts, *shape), dtype=first.dtype)
        for (expert, half), tensor in parts.items():
            expert_view(whole[expert], half).copy_(tensor)
        out[fused] = whole
    return out


def fuse_stream(tensors):
    """An export stream (name, tensor) with per-expert tensors -> the checkpoint's stream: one layer's
    per-expert tensors are held (copied: the stream's tensors are reused buffers) until the layer's last one,
    then go out fused, where they stood in the stream."""
    held: dict[str, torch.Tensor] = {}
    layer = None
    for name, tensor in tensors:
        split = split_expert_name(name)
        this = split[0].rsplit("mlp.experts.", 1)[0] if split else None
        if held and this != layer:
            yield from fuse_experts(held).items()
            held = {}
        if split is None:
            yield name, tensor
            continue
        layer = this
        held[name] = tensor.detach().clone()
    if held:
        yield from fuse_experts(held).items()


# ---- the family ---------------------------------------------------------------------------------------------


class GptOss(Family):
    name = "gpt_oss"
    architectures = {"GptOssForCausalLM": CAUSAL_LM}
    hf_config_class = "GptOssConfig"
    # checkpoint side: the router `mlp.router` (weight and bias) and the per-expert names above; model side:
    # transformers' GptOssTopKRouter (returns logits, scores, indices) and its fused GptOssExperts
    moe = MoeNames(
        router="mlp.router.weight",
        expert=EXPERT,
        gate="gate_proj.weight",
        up="up_proj.weight",
        down="down_proj.weight",
        model_router="mlp.router",
        model_gate_up="mlp.experts.gate_up_proj",
        model_down="mlp.experts.down_proj",
    )

    def features(self, cfg, path: str) -> dict:
        hf = cfg.to_dict()
        try:
            activation_kwargs(hf)
            windows = layer_windows(hf)
            yarn = yarn_kwargs(hf)
        except ValueError as e:
            raise ValueError(f"{e} (in {path})") from None
        if not getattr(cfg, "attention_bias", True):
            raise ValueError(f"attention_bias=false in {path}: gpt-oss's o_proj bias comes with the q/k/v ones here")
        if getattr(cfg, "num_experts_per_tok", 0) < 2:
            raise ValueError(
                f"num_experts_per_tok={cfg.num_experts_per_tok} in {path} is not supported: transformers' softmax "
                "over one chosen logit is 1, which megatron-core's router refuses to build"
            )
        full = [(w[0] + 1) if w is not None else None for w in windows]
        return {
            "qkv_bias": True,
            "linear_bias": True,
            "attention_sinks": True,
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "layer_windows": tuple(full),
            "yarn": tuple(
                (k, float(v))
                for k, v in (
                    ("factor", yarn["scaling_factor"]),
                    ("original_max_position_embeddings", yarn["original_max_position_embeddings"]),
                    ("beta_fast", yarn["beta_fast"]),
                    ("beta_slow", yarn["beta_slow"]),
                    ("truncate", yarn["correction_range_round_to_int"]),
                )
            ),
            "rope_theta": yarn["rotary_base"],
            "ffn_hidden_size": cfg.intermediate_size,
            "num_experts": cfg.num_local_experts,
            "moe_ffn_hidden_size": cfg.intermediate_size,
            "moe_top_k": cfg.num_experts_per_tok,
            "moe_pre_softmax": False,  # top-k of the logits, softmax over those k: megatron's default
        }

    def layer_rules(self, arch, layer):  # noqa: ARG002 - Family.layer_rules' signature
        d, f, heads = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_heads
        rules = attention_rules(arch, qkv_bias=True, qk_norm=False)
        rules += [
            TensorRule("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",), REPLICATED, ((d,),)),
            # one logit per head, split over TP with the heads
            TensorRule("self_attention.core_attention.softmax_offset", ("self_attn.sinks",), COLUMN, ((heads,),)),
            TensorRule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED, ((d,),)),
            TensorRule("mlp.router.weight", ("mlp.router.weight",), REPLICATED, ((arch.num_experts, d),)),
            TensorRule("mlp.router.bias", ("mlp.router.bias",), REPLICATED, ((arch.num_experts,),)),
        ]
        for e in range(arch.num_experts):
            prefix, local = EXPERT.format(e), f"mlp.experts.local_experts.{e}."
            gate_up = (prefix + "gate_proj.", prefix + "up_proj.")
            rules += [
                TensorRule(local + "linear_fc1.weight", tuple(p + "weight" for p in gate_up), FC1, ((f, d),) * 2, e),
                TensorRule(local + "linear_fc1.bias", tuple(p + "bias" for p in gate_up), FC1, ((f,),) * 2, e),
                TensorRule(local + "linear_fc2.weight", (prefix + "down_proj.weight",), ROW, ((d, f),), e),
                # a row-parallel bias is whole on every rank
                TensorRule(local + "linear_fc2.bias", (prefix + "down_proj.bias",), REPLICATED, ((d,),), e),
            ]
        return rules

    def checkpoint_stream(self, tensors):
        return fuse_stream(tensors)

    def engine_tensor(self, name: str) -> EngineTensor | None:
        """A per-expert name -> its view of transformers' fused expert parameter (the same name as the
        checkpoint's fused tensor); the router's weight and bias are the model's own names."""
        split = split_expert_name(name)
        if split is None:
            return None
        fused, expert, half = split
        return EngineTensor(
            fused, expert, parts=1 if half is None else 2, select=lambda param: expert_view(param[expert], half)
        )

    def tiny_config(
        self,
        common: dict,
        head_dim: int | None = None,
        experts: int = 4,
        top_k: int = 2,
        sliding_window: int = 4,
        layer_types: list[str] | None = None,
        swiglu_limit: float = 7.0,
        **options,
    ):
        """`intermediate_size` of `common` is each expert's width (gpt-oss has no dense MLP); YaRN over a
        quarter of `max_position_embeddings` (factor 4)."""
        positions = common["max_position_embeddings"]
        rope = {
            "rope_type": "yarn",
            "rope_theta": common["rope_parameters"]["rope_theta"],
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": max(positions // 4, 1),
        }
        config = super().tiny_config(dict(common, rope_parameters=rope), **options)
        config.head_dim = head_dim or common["hidden_size"] // common["num_attention_heads"]
        config.num_local_experts, config.num_experts_per_tok = experts, top_k
        config.sliding_window, config.swiglu_limit = sliding_window, swiglu_limit
        if layer_types is not None:
            config.layer_types = list(layer_types)
        return config


FAMILY = GptOss()
