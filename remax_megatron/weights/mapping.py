"""The one HF <-> Megatron weight mapping (names, layouts, TP shards, PP stages).

Three users: loading an HF directory into any TP/PP layout, exporting full HF
tensors for the rollout engine's weight sync, and checkpoint conversion. Which HF
tensors make which megatron parameter is the model family's declaration
(models/families: `Family.layer_rules` and its HF names outside the layers); this
module knows how each kind of rule is split, loaded and merged.

Megatron layouts (per TP rank r of tp, checked against transformers, PITFALLS.md):
- `linear_qkv` [ng_local * (q_per_group + 2) * head_dim, D]: for each of the
  rank's query groups g: the q heads of g, then k_g, then v_g. Rank r holds the
  groups [r * ng/tp, (r+1) * ng/tp). The qkv bias follows the same order.
- `linear_fc1` [2 * F/tp, D]: rank r's gate rows, then its up rows.
- `linear_proj`, `linear_fc2`: row parallel, split on dim 1.
- column-parallel linears of one HF tensor (MLA's q / kv projections, down ones
  included in the local spec): split on dim 0.
- word embeddings / output layer: vocab parallel over the padded vocab, split
  on dim 0; rows past the tokenizer's vocab are zero padding, dropped on export.
- layers: stage s of pp holds global layers [s * L/pp, (s+1) * L/pp) as local
  indices 0..L/pp-1.
- MoE experts (SequentialMLP): expert-parallel rank k of ep holds global experts
  [k * E/ep, (k+1) * E/ep) as `local_experts.0..E/ep-1`; each expert's fc1 / fc2 is
  split over expert tensor parallelism (etp: 1, or tp) like the dense MLP over tp.
  The router is replicated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from remax_megatron.models.arch import DTYPES, ModelArch
from remax_megatron.models.families import family_named
from remax_megatron.models.families.base import COLUMN, FC1, QKV, REPLICATED, ROW, VOCAB

# Norm names differ between the local layer spec and Transformer Engine's fused one (a MoE layer keeps
# its pre-MLP norm apart: no fused fc1 there).
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
# TE's grouped experts (TEGroupedMLP) name local expert j's weights `linear_fc1.weight{j}`.
_SEQUENTIAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def resolve_name(name: str, params) -> str:
    """`name` (local layer spec) as the model's state dict spells it: local spec, TE's fused norms, or
    TE's grouped experts. KeyError when none is there."""
    if name in params:
        return name
    candidates = []
    if name.startswith("decoder.layers."):
        layer, rest = name[len("decoder.layers.") :].split(".", 1)
        if rest in _LOCAL_TO_TE:
            candidates.append(f"decoder.layers.{layer}.{_LOCAL_TO_TE[rest]}")
        grouped = _SEQUENTIAL_EXPERT.search(rest)
        if grouped:
            candidates.append(f"decoder.layers.{layer}.mlp.experts.{grouped.group(2)}.weight{grouped.group(1)}")
    for candidate in candidates:
        if candidate in params:
            return candidate
    raise KeyError(name)


@dataclass(frozen=True)
class ParamSpec:
    """One megatron parameter and the HF tensors it is made of."""

    megatron: str  # global name: decoder.layers.<global layer>.… (local spec names)
    hf: tuple[str, ...]  # HF tensor names, in the order `kind` concatenates them
    kind: str  # REPLICATED | VOCAB | ROW | QKV | FC1 (models/families/base.py)
    stage: int  # pipeline stage that owns it
    layer: int | None = None  # global layer index, None outside the decoder layers
    shapes: tuple[tuple[int, ...], ...] = ()  # the HF tensors' shapes, one per name of `hf`
    expert: int | None = None  # MoE: the global expert index (its megatron name carries it)
    fp32: bool = False  # exported in float32 whatever the export dtype (TensorRule.fp32)

    def local_name(self, layers_per_stage: int, first_expert: int = 0) -> str:
        """The name in the owning stage's state_dict of the local layer spec (local layer index; an
        expert's local index on the expert-parallel rank whose first expert is `first_expert`)."""
        if self.layer is None:
            return self.megatron
        local = self.layer - self.stage * layers_per_stage
        rest = self.megatron.split(".", 3)[3]
        if self.expert is not None:
            rest = rest.replace(f"local_experts.{self.expert}.", f"local_experts.{self.expert - first_expert}.")
        return f"decoder.layers.{local}.{rest}"


class WeightMapping:
    """All parameters of a model of `arch` at (tp, pp, ep, etp), with shard/unshard rules."""

    def __init__(self, arch: ModelArch, tp: int, pp: int, padded_vocab: int, ep: int = 1, etp: int = 1):
        self.arch, self.tp, self.pp, self.padded_vocab, self.ep, self.etp = arch, tp, pp, padded_vocab, ep, etp
        self.layers_per_stage = arch.num_layers // pp
        self.experts_per_rank = arch.num_experts // ep if arch.is_moe else 0
        self.specs = self._build_specs()
        self._hf_shapes = {name: shape for spec in self.specs for name, shape in zip(spec.hf, spec.shapes)}

    # ---- the parameter list, in HF order -------------------------------------------------
    def _build_specs(self) -> list[ParamSpec]:
        a, last, family = self.arch, self.pp - 1, family_named(self.arch.family)
        embedding = ((a.vocab_size, a.hidden_size),)
        specs = [ParamSpec("embedding.word_embeddings.weight", (family.hf_embedding,), VOCAB, 0, shapes=embedding)]
        for i in range(a.num_layers):
            stage, prefix = i // self.layers_per_stage, family.hf_layer(i)
            specs += [
                ParamSpec(
                    f"decoder.layers.{i}.{rule.megatron}",
                    tuple(prefix + n for n in rule.hf),
                    rule.kind,
                    stage,
                    i,
                    rule.shapes,
                    rule.expert,
                    rule.fp32,
                )
                for rule in family.layer_rules(a, i)
            ]
        specs.append(
            ParamSpec(
                "decoder.final_layernorm.weight", (family.hf_final_norm,), REPLICATED, last, shapes=((a.hidden_size,),)
            )
        )
        if a.task == "reward":
            specs.append(
                ParamSpec("output_layer.weight", (family.hf_score,), REPLICATED, last, shapes=((1, a.hidden_size),))
            )
        elif not a.tie_word_embeddings:
            specs.append(ParamSpec("output_layer.weight", (family.hf_lm_head,), VOCAB, last, shapes=embedding))
        elif self.pp > 1:
            # Tied embeddings across stages: the last stage keeps its own copy of the
            # embedding as output weight (megatron keeps them equal). Not exported.
            specs.append(ParamSpec("output_layer.weight", (family.hf_embedding,), VOCAB, last, shapes=embedding))
        return specs

    def exported_specs(self) -> list[ParamSpec]:
        """Specs whose HF tensors go out on export (the tied output copy does not)."""
        return [
            s
            for s in self.specs
            if not (s.megatron == "output_layer.weight" and s.hf == (family_named(self.arch.family).hf_embedding,))
        ]

    def stage_specs(self, stage: int) -> list[ParamSpec]:
        return [s for s in self.specs if s.stage == stage]

    # ---- experts --------------------------------------------------------------------------
    def first_expert(self, ep_rank: int) -> int:
        return ep_rank * self.experts_per_rank

    def owns(self, spec: ParamSpec, ep_rank: int) -> bool:
        """Whether expert-parallel rank `ep_rank` holds `spec` (every rank holds the non-expert ones)."""
        return spec.expert is None or spec.expert // self.experts_per_rank == ep_rank

    def split(self, spec: ParamSpec) -> int:
        """How many shards `spec` is split into: tp, etp for an expert's weights, 1 if replicated."""
        if spec.kind == REPLICATED:
            return 1
        return self.etp if spec.expert is not None else self.tp

    def numel(self) -> int:
        """Parameters of the whole model at this vocab padding, each counted once (the planner's P)."""
        return sum(
            self.padded_vocab * self.arch.hidden_size
            if s.kind == VOCAB
            else sum(math.prod(shape) for shape in s.shapes)
            for s in self.exported_specs()
        )

    # ---- HF -> this rank's shard ---------------------------------------------------------
    def load_shard(self, spec: ParamSpec, read: Callable, tp_rank: int) -> torch.Tensor:
        """Build TP rank `tp_rank`'s shard of `spec`.

        `read(hf_name, dim, start, stop)` returns that slice of an HF tensor (dim None:
        the whole tensor), so a rank reads only the rows/columns it owns. For an expert's weights
        `tp_rank` is the expert-tensor-parallel rank (split over etp).
        """
        a, tp, r = self.arch, self.split(spec), tp_rank
        if spec.kind == REPLICATED:
            return read(spec.hf[0], None, None, None)
        if spec.kind == ROW:
            cols = _hf_shape(self, spec.hf[0])[1] // tp
            return read(spec.hf[0], 1, r * cols, (r + 1) * cols)
        if spec.kind == VOCAB:
            per_rank = self.padded_vocab // tp
            start, stop = r * per_rank, (r + 1) * per_rank
            real = read(spec.hf[0], 0, start, min(stop, a.vocab_size)) if start < a.vocab_size else None
            out = torch.zeros(
                (per_rank,) + tuple(_hf_shape(self, spec.hf[0])[1:]),
                dtype=real.dtype if real is not None else _dtype(self),
            )
            if real is not None:
                out[: real.shape[0]] = real
            return out
        if spec.kind in (FC1, COLUMN):
            rows = _hf_shape(self, spec.hf[0])[0] // tp
            return torch.cat([read(n, 0, r * rows, (r + 1) * rows) for n in spec.hf])
        if spec.kind == QKV:
            groups = a.num_kv_heads // tp
            qpg, hd = a.num_heads // a.num_kv_heads, a.head_dim
            g0 = r * groups
            q = read(spec.hf[0], 0, g0 * qpg * hd, (g0 + groups) * qpg * hd)
            k = read(spec.hf[1], 0, g0 * hd, (g0 + groups) * hd)
            v = read(spec.hf[2], 0, g0 * hd, (g0 + groups) * hd)
            tail = q.shape[1:]
            q = q.reshape(groups, qpg * hd, *tail)
            k = k.reshape(groups, hd, *tail)
            v = v.reshape(groups, hd, *tail)
            return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
        raise AssertionError(spec.kind)

    # ---- TP shards -> full HF tensors ----------------------------------------------------
    def merge_shards(
        self,
        spec: ParamSpec,
        shards: list[torch.Tensor],
        out: list[torch.Tensor] | None = None,
        copies: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Inverse of load_shard: the TP shards (rank order) -> [(hf_name, full tensor)].

        out: one tensor of the HF shape per name of `spec.hf` to write into (the exporter passes
        reused buffers, or the engine's own parameters); fresh ones by default. A replicated tensor
        is returned as is. copies: collect the (destination, source) copies here instead of running
        them (the caller runs a bucket's copies as one torch._foreach_copy_).
        """
        a = self.arch
        if spec.kind == REPLICATED:
            return [(spec.hf[0], shards[0])]
        if out is None:
            out = [torch.empty(_hf_shape(self, n), dtype=shards[0].dtype, device=shards[0].device) for n in spec.hf]

        def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
            if copies is None:
                dst.copy_(src)
            else:
                copies.append((dst, src))

        tp = len(shards)
        if spec.kind == ROW:
            cols = out[0].shape[1] // tp
            for r, shard in enumerate(shards):
                copy(out[0][:, r * cols : (r + 1) * cols], shard)
        elif spec.kind == COLUMN:
            rows = out[0].shape[0] // tp
            for r, shard in enumerate(shards):
                copy(out[0][r * rows : (r + 1) * rows], shard)
        elif spec.kind == VOCAB:
            rows = shards[0].shape[0]  # padded_vocab // tp: the padding rows are dropped
            for r, shard in enumerate(shards):
                start, stop = r * rows, min((r + 1) * rows, a.vocab_size)
                if start < stop:
                    copy(out[0][start:stop], shard[: stop - start])
        elif spec.kind == FC1:
            rows = out[0].shape[0] // tp  # each shard is [gate rows; up rows]
            for r, shard in enumerate(shards):
                copy(out[0][r * rows : (r + 1) * rows], shard[:rows])
                copy(out[1][r * rows : (r + 1) * rows], shard[rows:])
        elif spec.kind == QKV:
            # Each shard holds `groups` KV groups, each [q heads of the group; k; v] along dim 0.
            qpg, hd, groups = a.num_heads // a.num_kv_heads, a.head_dim, a.num_kv_heads // tp
            tail = shards[0].shape[1:]
            q, k, v = (t.view(a.num_kv_heads, -1, *tail) for t in out)
            for r, shard in enumerate(shards):
                g = slice(r * groups, (r + 1) * groups)
                grouped = shard.reshape(groups, (qpg + 2) * hd, *tail)
                copy(q[g], grouped[:, : qpg * hd])
                copy(k[g], grouped[:, qpg * hd : (qpg + 1) * hd])
                copy(v[g], grouped[:, (qpg + 1) * hd :])
        else:
            raise AssertionError(spec.kind)
        return list(zip(spec.hf, out))

    def shard_shape(self, spec: ParamSpec) -> tuple[int, ...]:
        """Shape of one TP (an expert's: ETP) shard of `spec` (same on every rank)."""
        a, tp = self.arch, self.split(spec)
        full = _hf_shape(self, spec.hf[0])
        if spec.kind == REPLICATED:
            return full
        if spec.kind == ROW:
            return (full[0], full[1] // tp)
        if spec.kind == VOCAB:
            return (self.padded_vocab // tp,) + full[1:]
        if spec.kind == FC1:
            return (2 * full[0] // tp,) + full[1:]  # a weight [2f/tp, in], a bias [2f/tp]
        if spec.kind == COLUMN:
            return (full[0] // tp,) + full[1:]
        if spec.kind == QKV:
            rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim // tp
            return (rows,) + full[1:]
        raise AssertionError(spec.kind)

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        return _hf_shape(self, hf_name)


def _dtype(mapping: WeightMapping) -> torch.dtype:
    return DTYPES.get(mapping.arch.torch_dtype, torch.float32)


def _hf_shape(mapping: WeightMapping, name: str) -> tuple[int, ...]:
    """Shape of an HF tensor of this architecture, from the family's rules (the config alone)."""
    return mapping._hf_shapes[name]
