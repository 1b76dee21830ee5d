"""What a model family is: the HF architectures it serves, how their config reads into a ModelArch,
and which HF tensors make each megatron parameter.

A family file (llama.py, qwen3.py, ...) subclasses `Family` and overrides only what differs; the
registry (families/__init__.py) maps architecture names to families. The one weight mapping
(weights/mapping.py) turns a family's `TensorRule`s into load / export / conversion, and the
planner counts parameters from the same rules, so a family never says twice what it is.

Megatron names are those of megatron-core's local layer spec (the TE spec's fused norm names are
translated in weights/mapping.py); shapes are the HF tensors' shapes.

The native rollout engine runs transformers' own model of the family, whose parameters carry the
checkpoint's names except where transformers 5 reorganises a routed MLP; a MoE family's `MoeNames` says
both sides, and `engine_tensor` / `engine_routers` answer the engine from them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from remax_megatron.models.arch import ModelArch

CAUSAL_LM, REWARD = "causal_lm", "reward"

# How a megatron parameter is made of its HF tensors and split over tensor parallelism
# (weights/mapping.py implements each kind).
REPLICATED = "replicated"  # one HF tensor, the same on every TP rank (norms, the reward head)
VOCAB = "vocab"  # split over the padded vocab on dim 0 (embedding, output layer)
ROW = "row"  # row-parallel linear: split on dim 1 (attention output, MLP down)
QKV = "qkv"  # q, k, v fused per query group: [q heads of g; k_g; v_g] for each group g
FC1 = "fc1"  # gate, up fused: per TP rank [its gate rows; its up rows]
COLUMN = "column"  # one HF tensor, column-parallel linear: split on dim 0 (MLA's projections)
KINDS = (REPLICATED, VOCAB, ROW, QKV, FC1, COLUMN)


@dataclass(frozen=True)
class TensorRule:
    """One megatron parameter of a decoder layer and the HF tensors it is made of."""

    megatron: str  # name inside the layer, e.g. "self_attention.linear_qkv.weight"
    hf: tuple[str, ...]  # names inside the HF layer, in the order `kind` concatenates them
    kind: str  # one of KINDS
    shapes: tuple[tuple[int, ...], ...]  # the HF tensors' shapes, one per name of `hf`
    # MoE: the global index of the expert this parameter belongs to (split over expert parallelism, and
    # over expert tensor parallelism instead of TP); its megatron name carries that global index
    expert: int | None = None
    # kept in float32 whatever dtype the weights are exported or synced in (a router's correction bias:
    # rounded to bfloat16, near-tied experts would be chosen differently than the actor chooses them)
    fp32: bool = False


@dataclass(frozen=True)
class MoeNames:
    """A routed MLP's HF names inside a decoder layer, on both sides of the native rollout engine.

    The checkpoint (what load, export and conversion read) holds the router and one tensor per expert
    matrix. transformers 5's model (what the native engine fills) fuses every expert of a layer into two
    parameters, gate_up [experts, 2 * ffn, hidden] = [gate; up] and down [experts, hidden, ffn], and
    routes with a top-k router module returning (logits, scores, expert indices [tokens, top_k]).
    """

    router: str  # checkpoint: the router's weight [experts, hidden], e.g. "mlp.gate.weight"
    expert: str  # checkpoint: the prefix of expert e's tensors, "{}" standing for e
    gate: str  # checkpoint, after `expert`: the SwiGLU gate [ffn, hidden]
    up: str  # checkpoint, after `expert`: the up projection [ffn, hidden]
    down: str  # checkpoint, after `expert`: the down projection [hidden, ffn]
    model_router: str  # transformers' model: the top-k router module (its `.weight` is `router`)
    model_gate_up: str  # transformers' model: every expert's [gate; up], fused
    model_down: str  # transformers' model: every expert's down, fused


# The names Qwen3-MoE, GLM-4.5 and DeepSeek-V3 share: per-expert checkpoint tensors, transformers 5's fused
# experts and its top-k router module `mlp.gate`
MLP_GATE_MOE = MoeNames(
    router="mlp.gate.weight",
    expert="mlp.experts.{}.",
    gate="gate_proj.weight",
    up="up_proj.weight",
    down="down_proj.weight",
    model_router="mlp.gate",
    model_gate_up="mlp.experts.gate_up_proj",
    model_down="mlp.experts.down_proj",
)


@dataclass(frozen=True)
class EngineTensor:
    """Where one checkpoint tensor lies in the transformers model the native rollout engine runs."""

    param: str  # the model's parameter name
    expert: int | None = None  # fused experts: the index on dim 0; None: the whole parameter
    part: int = 0  # which of `parts` equal row blocks of that expert's matrix ([gate; up]: 0, 1)
    parts: int = 1
    # the parameter -> the view this tensor fills, where it is no row block (gpt-oss: an interleaved half,
    # transposed); the parameter then takes `parts` tensors per expert
    select: Callable[[torch.Tensor], torch.Tensor] | None = None


class Family:
    """A model family. Subclasses set `name` and `architectures` and override what differs.

    The defaults describe a Llama-shaped decoder: RMSNorm, RoPE, grouped-query attention without
    biases, a SwiGLU MLP, HF names `model.layers.{i}.self_attn.q_proj.weight` and so on.
    """

    name: str = ""
    # HF architecture name -> CAUSAL_LM or REWARD (a *ForSequenceClassification with one label)
    architectures: dict[str, str] = {}
    # transformers config and model classes for tiny test models (builtin/tiny.py)
    hf_config_class: str = ""
    # HF tensor names outside the decoder layers
    hf_embedding = "model.embed_tokens.weight"
    hf_final_norm = "model.norm.weight"
    hf_lm_head = "lm_head.weight"
    hf_score = "score.weight"
    hf_layer_prefix = "model.layers.{layer}."
    # a MoE family's routed-MLP names (checkpoint and transformers' model); None: a dense MLP
    moe: MoeNames | None = None

    # ---- HF config -> ModelArch ----------------------------------------------------------
    def features(self, cfg, path: str) -> dict:
        """ModelArch fields this family sets beyond `read_common`'s (e.g. qkv_bias); raise ValueError
        (one line naming the setting in `path`) for what the family cannot run exactly."""
        if getattr(cfg, "attention_bias", False):
            raise ValueError(
                f"attention_bias=True in {path} is not supported: it adds a bias to o_proj, which "
                "megatron-core only has together with MLP biases (add_bias_linear)"
            )
        return {}

    # ---- weights ------------------------------------------------------------------------
    def layer_rules(self, arch: ModelArch, layer: int) -> list[TensorRule]:  # noqa: ARG002 - a family may vary by layer
        """The parameters of decoder layer `layer`, in HF order."""
        return attention_rules(arch, qkv_bias=arch.qkv_bias, qk_norm=arch.qk_layernorm) + dense_mlp_rules(arch)

    def hf_layer(self, layer: int) -> str:
        return self.hf_layer_prefix.format(layer=layer)

    def checkpoint_stream(self, tensors):
        """An export stream (name, tensor) in the mapping's names -> the stream a checkpoint of this family
        stores (the same, except where the checkpoint fuses tensors the mapping keeps apart: gpt-oss)."""
        return tensors

    # ---- the native rollout engine (transformers' model of this family) --------------------
    def engine_tensor(self, name: str) -> EngineTensor | None:
        """Where checkpoint tensor `name` lies in transformers' model when that model does not hold it
        under its own name (a routed MLP's router and experts, see MoeNames); None otherwise."""
        if self.moe is None:
            return None
        found = self._moe_pattern.match(name)
        if found is None:
            return None
        what = next(part for part in ("router", "gate", "up", "down") if found.group(part))
        prefix, expert = self.hf_layer(int(found.group("layer"))), found.group("expert")
        if what == "router":
            return EngineTensor(f"{prefix}{self.moe.model_router}.weight")
        if what == "down":
            return EngineTensor(f"{prefix}{self.moe.model_down}", int(expert))
        return EngineTensor(f"{prefix}{self.moe.model_gate_up}", int(expert), part=int(what == "up"), parts=2)

    def engine_routers(self, model) -> list:
        """transformers' top-k router modules of `model`, in layer order; [] for a dense family."""
        if self.moe is None:
            return []
        return [
            model.get_submodule(f"{self.hf_layer(layer)}{self.moe.model_router}")
            for layer in self.routed_layers(model.config)
        ]

    def routed_layers(self, config) -> range:
        """The decoder layers of a transformers config of this family whose MLP is routed (a MoE family: all)."""
        return range(config.num_hidden_layers)

    @cached_property
    def _moe_pattern(self) -> re.Pattern:
        """Checkpoint names of the routed MLP: groups layer, expert, and one of router / gate / up / down."""
        moe = self.moe
        layer = _template(self.hf_layer_prefix, "{layer}", r"(?P<layer>\d+)")
        expert = _template(moe.expert, "{}", r"(?P<expert>\d+)")
        parts = "|".join(f"(?P<{k}>{re.escape(getattr(moe, k))})" for k in ("gate", "up", "down"))
        return re.compile(f"^{layer}(?:(?P<router>{re.escape(moe.router)})|{expert}(?:{parts}))$")

    # ---- tiny models --------------------------------------------------------------------
    def tiny_config(self, common: dict, **options):
        """A transformers config of this family from `common` (the shared tiny-model fields, see
        builtin/tiny.py) and family options such as head_dim; unknown options raise ValueError."""
        import transformers

        unknown = sorted(k for k, v in options.items() if v is not None)
        if unknown:
            raise ValueError(f"{', '.join(unknown)} is not an option of the {self.name} family")
        return getattr(transformers, self.hf_config_class)(**common)

    def architecture_for(self, task: str) -> str:
        for architecture, served in self.architectures.items():
            if served == task:
                return architecture
        raise ValueError(
            f"the {self.name} family has no {'reward model' if task == REWARD else 'causal LM'} "
            f"architecture (it serves {', '.join(self.architectures)})"
        )


def attention_rules(arch: ModelArch, *, qkv_bias: bool, qk_norm: bool) -> list[TensorRule]:
    """Pre-norm grouped-query attention: input norm, fused q/k/v (+ bias), per-head q/k RMSNorm, output."""
    d, hd, q, kv = arch.hidden_size, arch.head_dim, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    rules = [
        TensorRule("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED, ((d,),)),
        TensorRule(
            "self_attention.linear_qkv.weight",
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            QKV,
            ((q, d), (kv, d), (kv, d)),
        ),
    ]
    if qkv_bias:
        rules.append(
            TensorRule(
                "self_attention.linear_qkv.bias",
                ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                QKV,
                ((q,), (kv,), (kv,)),
            )
        )
    if qk_norm:  # RMSNorm over one head's head_dim, shared by the heads
        rules += [
            TensorRule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED, ((hd,),)),
            TensorRule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED, ((hd,),)),
        ]
    rules.append(TensorRule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW, ((d, q),)))
    return rules


# A dense decoder layer's SwiGLU MLP in HF checkpoints and transformers' models: gate, up, down [ffn|hidden, ...]
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def dense_mlp_rules(arch: ModelArch) -> list[TensorRule]:
    """Pre-norm SwiGLU MLP: post-attention norm, fused gate/up, down."""
    d, f = arch.hidden_size, arch.ffn_hidden_size
    gate, up, down = DENSE_MLP
    return [
        TensorRule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED, ((d,),)),
        TensorRule("mlp.linear_fc1.weight", (gate, up), FC1, ((f, d), (f, d))),
        TensorRule("mlp.linear_fc2.weight", (down,), ROW, ((d, f),)),
    ]


def check_routing(top_k: int, renormalise: bool, path: str) -> None:
    """Top-1 routing renormalised over its one expert (weight 1.0) is what megatron-core refuses to
    build (its router would get no gradient); refuse it by name rather than change the weights."""
    if top_k == 1 and renormalise:
        raise ValueError(
            f"num_experts_per_tok=1 with renormalised routing weights in {path} is not supported: "
            "megatron-core's router needs the softmax before a top-1 selection"
        )


def moe_mlp_rules(arch: ModelArch, names: MoeNames) -> list[TensorRule]:
    """Pre-norm routed MLP: post-attention norm, the router [experts, hidden], and per expert a SwiGLU MLP
    (megatron's SequentialMLP names, global expert index; the HF names are the checkpoint's of `names`)."""
    d, f, n = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
    rules = [
        TensorRule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED, ((d,),)),
        TensorRule("mlp.router.weight", (names.router,), REPLICATED, ((n, d),)),
    ]
    for e in range(n):
        prefix = names.expert.format(e)
        rules += [
            TensorRule(
                f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                (prefix + names.gate, prefix + names.up),
                FC1,
                ((f, d), (f, d)),
                expert=e,
            ),
            TensorRule(
                f"mlp.experts.local_experts.{e}.linear_fc2.weight", (prefix + names.down,), ROW, ((d, f),), expert=e
            ),
        ]
    return rules


def _template(template: str, field: str, group: str) -> str:
    """A regular expression for the names `template` makes: its text literal, `field` matched by `group`."""
    head, tail = template.split(field)
    return re.escape(head) + group + re.escape(tail)


def layer_windows_of(cfg) -> tuple[int | None, ...] | None:
    """Each layer's attention window as an HF config sets it: W (a query sees itself and the W - 1 keys
    before it) or None for full causal; None when no layer slides.

    transformers 5 lists each layer's attention in `layer_types` ("sliding_attention" where the window
    applies: Qwen2 / Qwen3 from use_sliding_window and max_window_layers); configs without it (Mistral,
    Mixtral, Qwen3-MoE) window every layer when `sliding_window` is set.
    """
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return (int(window),) * cfg.num_hidden_layers
    if "sliding_attention" not in layer_types:
        return None
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
