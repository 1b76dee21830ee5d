"""The DeepSeek-style MoE that GLM-4.5 and DeepSeek-V3 share: what their families import.

- The first `first_k_dense_replace` layers have a dense SwiGLU MLP (`intermediate_size`); every later
  one routes over `n_routed_experts` experts (`moe_intermediate_size` each) and adds `n_shared_experts`
  shared experts run on every token (megatron's SharedExpertMLP of width moe_intermediate_size *
  n_shared_experts, HF `mlp.shared_experts.{gate,up,down}_proj`).
- Routing (HF `noaux_tc`): sigmoid scores s; experts chosen by the top-k of s + b, where b is the
  per-expert correction bias (HF `mlp.gate.e_score_correction_bias`, megatron's router buffer
  `expert_bias`, fp32, frozen: hf_config._moe_kwargs says why); weights are the chosen experts' s,
  renormalised, times `routed_scaling_factor`. Group-limited top-k (`n_group`, `topk_group`) picks
  groups first; megatron scores a group by the sum of its top (top_k / topk_group) experts' scores,
  transformers by its top 2: configs where those differ are refused, so are `norm_topk_prob: false`
  (megatron always renormalises sigmoid top-k) and a top-1 router (megatron does not renormalise it).
- Multi-token-prediction layers (`num_nextn_predict_layers`, stored after the decoder layers) are not
  built or trained: an import skips them with one console line, an export writes none (and says so).
"""

from __future__ import annotations

import sys

from remax_megatron.models.arch import ModelArch
from remax_megatron.models.families.base import (
    FC1,
    REPLICATED,
    ROW,
    Family,
    MLP_GATE_MOE,
    TensorRule,
    dense_mlp_rules,
    moe_mlp_rules,
)

MOE_NAMES = MLP_GATE_MOE  # a DeepSeek-style routed MLP's names (models/families/base.py)
EXPERT_BIAS = "mlp.gate.e_score_correction_bias"  # [experts], fp32 in both checkpoint and model
SHARED = "mlp.shared_experts."


def moe_features(cfg, path: str) -> dict:
    """The ModelArch fields of a DeepSeek-style routed MLP from an HF config; one-line ValueErrors for
    routing megatron-core cannot express exactly."""
    experts, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    scoring, method = getattr(cfg, "scoring_func", "sigmoid"), getattr(cfg, "topk_method", "noaux_tc")
    if scoring != "sigmoid" or method not in (None, "noaux_tc"):
        raise ValueError(
            f"scoring_func={scoring!r}, topk_method={method!r} in {path}: only sigmoid scores with the "
            "correction bias ('noaux_tc', DeepSeek-V3 and GLM-4.5's routing) are supported"
        )
    if not getattr(cfg, "norm_topk_prob", True):
        raise ValueError(
            f"norm_topk_prob=false in {path} is not supported: megatron-core always renormalises sigmoid "
            "top-k weights (set it to true only if the checkpoint was trained that way)"
        )
    if top_k < 2:
        raise ValueError(
            f"num_experts_per_tok={top_k} in {path} is not supported: megatron-core does not renormalise a "
            "top-1 sigmoid router's weight as transformers does"
        )
    groups, group_topk = getattr(cfg, "n_group", 1) or 1, getattr(cfg, "topk_group", 1) or 1
    if groups > 1 and group_topk < groups:
        if experts % groups or top_k % group_topk or top_k // group_topk != 2:
            raise ValueError(
                f"n_group={groups}, topk_group={group_topk}, num_experts_per_tok={top_k} in {path}: megatron-core "
                f"scores a group by its top {top_k // group_topk} experts where transformers sums the top 2; "
                "only configs where num_experts_per_tok / topk_group = 2 route the same"
            )
    else:
        groups = group_topk = None  # every group chosen: plain top-k
    first_dense = min(int(getattr(cfg, "first_k_dense_replace", 0) or 0), cfg.num_hidden_layers)
    if first_dense >= cfg.num_hidden_layers:
        raise ValueError(f"first_k_dense_replace={first_dense} in {path} leaves no MoE layer: it is a dense model")
    scaling = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
    return {
        "num_experts": experts,
        "moe_ffn_hidden_size": cfg.moe_intermediate_size,
        "moe_top_k": top_k,
        "moe_pre_softmax": False,
        "moe_score_function": "sigmoid",
        "moe_expert_bias": True,
        "moe_num_groups": groups,
        "moe_group_topk": group_topk,
        "moe_topk_scaling_factor": scaling if scaling != 1.0 else None,
        "first_dense_layers": first_dense,
        "moe_shared_ffn_hidden_size": cfg.moe_intermediate_size * (getattr(cfg, "n_shared_experts", 0) or 0),
        "mtp_layers": int(getattr(cfg, "num_nextn_predict_layers", 0) or 0),
    }


def mlp_rules(arch: ModelArch, layer: int) -> list[TensorRule]:
    """Layer `layer`'s MLP: dense for the first layers, else the router (+ its correction bias), the routed
    experts and the shared experts (TP-split like a dense MLP)."""
    if not arch.is_moe_layer(layer):
        return dense_mlp_rules(arch)
    d, n, fs = arch.hidden_size, arch.num_experts, arch.moe_shared_ffn_hidden_size
    rules = moe_mlp_rules(arch, MOE_NAMES)
    rules.insert(2, TensorRule("mlp.router.expert_bias", (EXPERT_BIAS,), REPLICATED, ((n,),), fp32=True))
    if fs:
        rules += [
            TensorRule(
                "mlp.shared_experts.linear_fc1.weight",
                (SHARED + "gate_proj.weight", SHARED + "up_proj.weight"),
                FC1,
                ((fs, d), (fs, d)),
            ),
            TensorRule("mlp.shared_experts.linear_fc2.weight", (SHARED + "down_proj.weight",), ROW, ((d, fs),)),
        ]
    return rules


def moe_layers(config) -> range:
    """The decoder layers of a transformers config whose MLP is routed."""
    return range(getattr(config, "first_k_dense_replace", 0) or 0, config.num_hidden_layers)


class DeepseekMoeFamily(Family):
    """What a family with this MoE inherits: the routed MLP's names on both sides of the native engine and
    its routed layers (the first are dense). Subclasses add their attention (`layer_rules` = their
    attention rules + `mlp_rules`) and config features (+ `moe_features`)."""

    moe = MOE_NAMES

    def routed_layers(self, config) -> range:
        return moe_layers(config)


def say_mtp_dropped(arch: ModelArch, where: str) -> None:
    """The one console line of an import that skips `where`'s multi-token-prediction layers."""
    if arch.mtp_layers:
        print(
            f"{where}: its {arch.mtp_layers} multi-token-prediction layer(s) (num_nextn_predict_layers) are "
            "not trained here: skipped on import, and exports write none",
            file=sys.stderr,
            flush=True,
        )


def say_mtp_not_written(arch: ModelArch, where: str) -> None:
    """The one console line of an export whose source had multi-token-prediction layers."""
    if arch.mtp_layers:
        print(
            f"{where}: wrote no multi-token-prediction layers (the source had {arch.mtp_layers}; its "
            "config.json's num_nextn_predict_layers is kept, speculative decoding with them needs the "
            "original weights)",
            file=sys.stderr,
            flush=True,
        )
