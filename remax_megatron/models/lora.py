"""LoRA adapters on megatron-core's ColumnParallelLinear / RowParallelLinear (the actor only).

    apply_lora(actor, LoraOptions(rank=8, alpha=16))   # after build, before load / DDP: base frozen
    with adapters_disabled(actor): ...                # the base model (the KL reference)
    module.merged_weight()                            # W + (alpha/r) B A of this TP shard, fp32

An adapted linear keeps its class's parameters and names (`linear_qkv.weight` loads, exports and
checkpoints as before) and gains `lora_A` [r, in] and `lora_B` [out, r]; its output becomes
base(x) + (alpha / r) * B A dropout(x). Only the adapters train.

Tensor parallelism (megatron's autograd mappings do the communication):
- column parallel (linear_qkv, linear_fc1): x is whole on every TP rank. A [r, in] is replicated,
  B [out / tp, r] is split on dim 0 like the weight. h = A x is computed on every rank and passed
  through copy_to_tensor_model_parallel_region, whose backward all-reduces dL/dh over TP: each rank
  then holds the full gradient of A (the same on every rank, a TP duplicate for the grad norm).
- row parallel (linear_proj, linear_fc2): x is split on its last dim. A [r, in / tp] is split on
  dim 1 like the weight, B [out, r] is replicated. A x is summed over TP
  (reduce_from_tensor_model_parallel_region) before B, so B's gradient is whole on every rank.
- sequence parallel: column parallel gets x split over the sequence, so A x [s / tp, b, r] is gathered
  over the sequence (gather_from_sequence_parallel_region; its backward reduce-scatters dL/dh); row
  parallel reduce-scatters A x over the sequence before B. A (column) and B (row) then see only their
  rank's tokens: they are marked `sequence_parallel`, and megatron's finalize_model_grads sums their
  gradients over TP, as it does for the norms.
Merged per TP shard: B_local A (column) and B A_local (row) are exactly that rank's shard of B A.
Checkpoints: B of linear_fc1 (a gated MLP) is saved gate / up apart, as megatron saves fc1's weight, so a
checkpoint of one TP size loads at another.
A's init is drawn for the full matrix from a seed of (options.seed, global layer, module) and
sliced, so every layout starts from the same adapters (world 1 == TP2 == PP2).
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from remax_megatron.models.arch import (  # noqa: F401  (is_adapter: re-export)
    LORA_TARGETS,
    LoraOptions,
    check_lora_targets,
    is_adapter,
)


class _LoraLinear:
    """What both adapted classes share: the adapter branch and the fp32 merge."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_enabled: bool
    lora_dropout: nn.Module

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This TP rank's shard of W + (alpha / r) B A, computed in fp32 (the caller casts once)."""
        return torch.addmm(self.weight.float(), self.lora_B.float(), self.lora_A.float(), alpha=self.lora_scale)


class LoraColumnParallelLinear(ColumnParallelLinear, _LoraLinear):
    """ColumnParallelLinear + LoRA: A [r, in] replicated, B [out / tp, r] split like the weight."""

    lora_glu: bool = False  # linear_fc1 of a gated MLP: rows are [gate; up] per TP rank, B's rows too

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_enabled:
            return output, bias
        h = F.linear(self.lora_dropout(input_), self.lora_A)  # [s, b, r] equal on every TP rank; SP: [s / tp, b, r]
        if self.sequence_parallel:
            h = tensor_parallel.gather_from_sequence_parallel_region(h, group=self.tp_group)  # [s, b, r]
        else:
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group)  # bwd: dA summed over TP
        return output + self.lora_scale * F.linear(h, self.lora_B), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0, "bias": 0, "lora_B": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.lora_glu:
            # As megatron's MLP does for fc1's weight: gate and up rows saved as two tensors, so that
            # another TP size reads [gate_r; up_r] shards right (a plain axis-0 split would interleave them).
            key = f"{prefix}lora_B"
            out[key] = apply_swiglu_sharded_factory(
                out[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
            )
        return out


class LoraRowParallelLinear(RowParallelLinear, _LoraLinear):
    """RowParallelLinear + LoRA: A [r, in / tp] split like the weight, B [out, r] replicated."""

    def forward(self, input_):
        output, bias = super().forward(input_)
        if not self.lora_enabled:
            return output, bias
        h = F.linear(self.lora_dropout(input_), self.lora_A)  # [s, b, r], this rank's input columns only
        if self.sequence_parallel:
            h = tensor_parallel.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)  # [s / tp, b, r]
        else:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return output + self.lora_scale * F.linear(h, self.lora_B), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 1, "lora_A": 1},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


_ADAPTED = {ColumnParallelLinear: LoraColumnParallelLinear, RowParallelLinear: LoraRowParallelLinear}


def _full_A(options: LoraOptions, layer_number: int, path: str, in_features: int) -> torch.Tensor:
    """A [r, in_features] (the whole matrix) as PEFT draws it, kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(in)),
    from a generator seeded by the module's global identity: the same on every rank and layout."""
    g = torch.Generator().manual_seed(options.seed * 1_000_003 + zlib.crc32(f"{layer_number}.{path}".encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(options.rank, in_features, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _adapt(module, options: LoraOptions, layer_number: int, path: str) -> None:
    cls = _ADAPTED.get(type(module))
    if cls is None:
        raise ValueError(
            f"actor.lora_targets: {path} is a {type(module).__name__}, not megatron's "
            "ColumnParallelLinear / RowParallelLinear (LoRA runs on the local layer spec)"
        )
    weight = module.weight
    tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
    out_local, in_local = weight.shape
    kw = dict(dtype=weight.dtype, device=weight.device)
    if cls is LoraColumnParallelLinear:
        a = _full_A(options, layer_number, path, in_local)  # [r, in]
        b = torch.zeros(out_local, options.rank, **kw)  # [out / tp, r]
    else:
        full = _full_A(options, layer_number, path, in_local * tp)  # [r, in]
        a = full[:, tp_rank * in_local : (tp_rank + 1) * in_local]  # [r, in / tp]
        b = torch.zeros(out_local, options.rank, **kw)  # [out, r]
    module.__class__ = cls
    if cls is LoraColumnParallelLinear and path.endswith("linear_fc1") and module.config.gated_linear_unit:
        module.lora_glu = True
    module.lora_A = nn.Parameter(a.to(**kw).contiguous())
    module.lora_B = nn.Parameter(b)
    module.lora_scale, module.lora_enabled = options.scale, True
    module.lora_dropout = nn.Dropout(options.dropout) if options.dropout > 0 else nn.Identity()
    split_a = cls is LoraRowParallelLinear
    # What grad-norm clipping and checkpoints read: which adapter is a TP shard (counted on every rank),
    # which a TP duplicate (counted once). Dense weights: megatron's DDP reduces them over DP.
    tensor_parallel.set_tensor_model_parallel_attributes(module.lora_A, split_a, 1 if split_a else -1, 1)
    tensor_parallel.set_tensor_model_parallel_attributes(module.lora_B, not split_a, 0 if not split_a else -1, 1)
    for p in (module.lora_A, module.lora_B):
        p.allreduce = True
    # Sequence parallel: the replicated adapter sees this rank's tokens only; finalize_model_grads sums it over TP.
    (module.lora_B if split_a else module.lora_A).sequence_parallel = module.sequence_parallel


def apply_lora(model, options: LoraOptions) -> list[str]:
    """Adapt `options.targets` in every decoder layer of `model` (this stage's), freeze everything else.

    Returns the adapted modules' names. Call before DistributedDataParallel wraps the model (DDP
    takes the parameters that require grad) and before weights are loaded or a checkpoint is read.
    """
    unknown = sorted(set(options.targets) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"actor.lora_targets: unknown {unknown}; choose from {list(LORA_TARGETS)}")
    mla = bool(getattr(model.config, "multi_latent_attention", False))
    check_lora_targets(options.targets, mla, getattr(getattr(model, "arch", None), "architecture", "this model"))
    model.requires_grad_(False)
    adapted = []
    for i, layer in enumerate(model.decoder.layers):
        for path, module in layer.named_modules():
            if path.rsplit(".", 1)[-1] not in options.targets:
                continue
            if ".experts." in f".{path}.":
                raise ValueError(
                    f"actor.lora_targets: {path} is a MoE expert; LoRA on experts is not supported "
                    "(use actor.lora_targets=[linear_qkv,linear_proj])"
                )
            _adapt(module, options, layer.layer_number, path)
            adapted.append(f"decoder.layers.{i}.{path}")
    if not adapted:
        raise ValueError(f"actor.lora_targets={list(options.targets)} matched no linear layer of the actor")
    if model.config.recompute_granularity == "full" and model.pre_process:
        # Full recompute wraps each layer in megatron's reentrant CheckpointFunction, which runs no backward
        # (so gives the adapters inside no gradient) when none of its inputs requires grad: the frozen
        # embedding's output would not. transformers' enable_input_require_grads does the same for PEFT.
        model.embedding.register_forward_hook(_input_requires_grad)
    return adapted


def _input_requires_grad(_module, _args, output):  # a forward hook
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def lora_modules(model) -> dict[str, _LoraLinear]:
    """Adapted module of each adapted weight, by the weight's state-dict name ("...linear_qkv.weight")."""
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, _LoraLinear)}


def has_adapters(model) -> bool:
    return any(isinstance(m, _LoraLinear) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model inside: every adapter branch skipped (the KL reference of a LoRA actor)."""
    modules = [m for m in model.modules() if isinstance(m, _LoraLinear)]
    states = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, state in zip(modules, states):
            m.lora_enabled = state
