"""Export full HF-named tensors from a TP/PP-sharded megatron model, as an iterator.

Every rank of the model-parallel (TP x PP) group yields the same stream
`(hf_name, tensor)` in HF order. The stream is cut into buckets of consecutive
tensors of one pipeline stage; for each bucket, every TP rank of the owning
stage packs its shards into one flat buffer (already cast to the output dtype)
and broadcasts it over the whole model-parallel group, and every rank merges the
TP shards into HF tensors. So a bucket costs `tp` broadcasts whatever its tensor
count, and the bytes moved are those of one plain broadcast of the model.

Buffers (one receive buffer per TP rank, about a bucket / tp each, and one
merge buffer of a bucket that holds the HF tensors handed out) are allocated
once per exporter. `HFExporter` keeps them between exports
so that repeated syncs touch no fresh memory: on CPU, receiving into fresh pages
made a gloo broadcast 3-7x slower (page faults; docs/benchmarks.md). Callers on
CUDA `release()` them after each export (the caching allocator hands the blocks
back cheaply and training gets the memory).

Data-parallel replicas export independently (their weights are equal). Used by
the rollout weight sync, HF export and checkpoint conversion.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import ProcessGroups, comm_device
from remax_megatron.weights.load import mapping_for, uses_te_names
from remax_megatron.weights.mapping import REPLICATED, ParamSpec, WeightMapping


def export_hf_weights(model, dtype: torch.dtype | None = None, bucket_mb: float = 256.0,
                      groups: ProcessGroups | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One export of `model`: iter(HFExporter(model, dtype, bucket_mb, groups))."""
    return iter(HFExporter(model, dtype=dtype, bucket_mb=bucket_mb, groups=groups))


class HFExporter:
    """Yields (hf_name, full tensor) for every HF tensor of `model`, on every rank of its TP x PP group.

        exporter = HFExporter(actor, dtype=torch.bfloat16, bucket_mb=256)
        for name, tensor in exporter:   # every iteration is a fresh export of the current weights
            ...

    dtype: output dtype (e.g. the engine's), applied before anything is sent; None keeps the
        parameter dtype. bucket_mb: merged size of the tensors sent together (a larger tensor
        goes alone). A yielded tensor is a view into a reused buffer: use it (copy it, write
        it) or clone it before advancing the iterator.
    """

    def __init__(self, model, dtype: torch.dtype | None = None, bucket_mb: float = 256.0,
                 groups: ProcessGroups | None = None):
        groups = groups or ProcessGroups.current()  # `model`'s layout: the actor's groups
        if not bucket_mb > 0:
            raise ValueError(f"export bucket size {bucket_mb!r} MiB must be > 0 (rollout.sync_bucket_mb)")
        self.mapping = mapping = mapping_for(model)
        self.params = {k: v for k, v in model.state_dict(keep_vars=True).items()
                       if not k.endswith("_extra_state")}
        self.te_names = uses_te_names(self.params)
        first = next(iter(self.params.values()))
        self.plan = _plan_buckets(mapping, int(bucket_mb * 2**20 / (dtype or first.dtype).itemsize))
        self.me = (groups.pp_rank, groups.tp_rank)
        self.group = groups.mp if mapping.tp * mapping.pp > 1 else None
        # The buffers live where the group's collectives run (the current GPU under NCCL).
        self.dtype = dtype or first.dtype
        self.device = comm_device(self.group) if self.group is not None else first.device
        self._source_of: dict[tuple[int, int], int] | None = None
        self._receive: list[torch.Tensor] | None = None  # per TP rank, flat
        self._merged: torch.Tensor | None = None         # flat, HF-shaped views per bucket

    def _local(self, spec: ParamSpec) -> torch.Tensor:
        """This rank's shard of `spec` (a live parameter)."""
        return self.params[spec.local_name(self.mapping.layers_per_stage, te_names=self.te_names)].detach()

    def release(self) -> None:
        """Free the buffers (the next export allocates them again)."""
        self._receive = self._merged = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket

    @torch.no_grad()
    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One export, bucket by bucket: [(hf_name, tensor)] as views into one reused flat buffer.

        The views are valid until the next bucket is requested. The rollout sync hands each
        bucket to the engine as it is (one `load_weights` call, no further copy).
        """
        mapping = self.mapping
        if self._merged is None:
            self._merged = torch.empty(max(_merged_numel(mapping, specs) for _, specs in self.plan),
                                       dtype=self.dtype, device=self.device)
        if self.group is not None and self._receive is None:
            self._receive = [torch.empty(max(_sent_numel(mapping, specs, t) for _, specs in self.plan),
                                         dtype=self.dtype, device=self.device) for t in range(mapping.tp)]
        if self.group is not None and self._source_of is None:
            self._source_of = _source_ranks(self.group, *self.me)
        for stage, specs in self.plan:
            shards = self._receive_bucket(stage, specs) if self.group is not None else \
                {s.megatron: [self._local(s)] for s in specs}
            bucket, offset = [], 0
            for spec in specs:
                out = []
                for name in spec.hf:
                    shape = mapping.hf_shape(name)
                    out.append(self._merged[offset:offset + math.prod(shape)].view(shape))
                    offset += out[-1].numel()
                for (name, tensor), view in zip(mapping.merge_shards(spec, shards[spec.megatron], out=out), out):
                    if tensor is not view:  # replicated: returned as received
                        view.copy_(tensor)
                    bucket.append((name, view))
            yield bucket

    def _receive_bucket(self, stage: int, specs: list[ParamSpec]) -> dict[str, list[torch.Tensor]]:
        """Every TP rank of `stage` broadcasts its shards of `specs` over the model-parallel group.

        Returns megatron name -> the TP shards in rank order (views into the receive buffers).
        """
        shards: dict[str, list[torch.Tensor]] = {s.megatron: [] for s in specs}
        for t in range(self.mapping.tp):
            sent = [s for s in specs if _sends(s, t)]
            if not sent:
                continue
            flat, offset = self._receive[t][:_sent_numel(self.mapping, specs, t)], 0
            for spec in sent:
                shape = self.mapping.shard_shape(spec)
                view = flat[offset:offset + math.prod(shape)].view(shape)
                if self.me == (stage, t):
                    view.copy_(self._local(spec))  # casts to the output dtype before sending
                shards[spec.megatron].append(view)
                offset += view.numel()
            dist.broadcast(flat, src=self._source_of[stage, t], group=self.group)
        return shards


def _sends(spec: ParamSpec, tp_rank: int) -> bool:
    """Replicated tensors are sent by TP rank 0 only; split ones by every TP rank."""
    return spec.kind != REPLICATED or tp_rank == 0


def _plan_buckets(mapping: WeightMapping, bucket_elems: int) -> list[tuple[int, list[ParamSpec]]]:
    """Consecutive exported specs of one stage, grouped while their merged size fits `bucket_elems`."""
    buckets: list[tuple[int, list[ParamSpec]]] = []
    size = 0
    for spec in mapping.exported_specs():
        numel = _merged_numel(mapping, [spec])
        if buckets and buckets[-1][0] == spec.stage and size + numel <= bucket_elems:
            buckets[-1][1].append(spec)
            size += numel
        else:
            buckets.append((spec.stage, [spec]))
            size = numel
    return buckets


def _merged_numel(mapping: WeightMapping, specs: list[ParamSpec]) -> int:
    return sum(math.prod(mapping.hf_shape(n)) for s in specs for n in s.hf)


def _sent_numel(mapping: WeightMapping, specs: list[ParamSpec], tp_rank: int) -> int:
    """Elements TP rank `tp_rank` sends for a bucket of `specs`."""
    return sum(math.prod(mapping.shard_shape(s)) for s in specs if _sends(s, tp_rank))


def _source_ranks(group, pp_rank: int, tp_rank: int) -> dict[tuple[int, int], int]:
    """Global rank of every (pp_rank, tp_rank) of the model-parallel group (one tiny all-gather)."""
    mine = torch.tensor([pp_rank, tp_rank, dist.get_rank()], dtype=torch.long, device=comm_device(group))
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return {(p, t): r for p, t, r in (row.tolist() for row in table)}

