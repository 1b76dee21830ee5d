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

MoE experts are split over expert parallelism, whose groups span data-parallel
replicas (and TP ranks): before a bucket's broadcasts, each expert-parallel rank
of the owning stage broadcasts its experts of the bucket over its expert-parallel
group, so every rank of that stage holds all of them (its expert-TP shard); the
model-parallel broadcasts then carry them to the other stages as usual. A tensor
that every rank of the model-parallel group already holds (replicated over TP at
PP = 1: norms, the router, experts at etp = 1) is not broadcast again. A tensor
its family keeps in float32 (TensorRule.fp32: a router's correction bias) is
exported in float32 whatever `dtype` is, and travels in its own broadcast.

Data-parallel replicas export independently (their weights are equal). Used by
the rollout weight sync, HF export and checkpoint conversion (save_hf_dir).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import ProcessGroups, comm_device
from remax_megatron.weights.load import expert_layout, local_param_name, mapping_for
from remax_megatron.weights.mapping import ParamSpec, WeightMapping


def export_hf_weights(
    model, dtype: torch.dtype | None = None, bucket_mb: float = 256.0, groups: ProcessGroups | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One export of `model`: iter(HFExporter(model, dtype, bucket_mb, groups))."""
    return iter(HFExporter(model, dtype=dtype, bucket_mb=bucket_mb, groups=groups))


def save_hf_dir(
    model,
    out_dir: str,
    side_files_from: str,
    *,
    tool: str,
    writer: bool,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    groups: ProcessGroups | None = None,
) -> None:
    """`model` as a Hugging Face directory: one export (a collective over its TP x PP group, every rank
    calls it), written by the `writer` rank (weights/hf_io.HFDirWriter: atomic, config.json stating the
    tensors' dtype) with the config and tokenizer of `side_files_from`. The HF export of
    tools/convert_megatron_to_hf.py and of the trainer's checkpoint.hf_every."""
    from remax_megatron.weights.hf_io import HFDirWriter

    tensors = export_hf_weights(model, dtype=dtype, groups=groups)
    if not writer:
        for _ in tensors:  # every rank takes part in the gathers and broadcasts
            pass
        return
    from remax_megatron.models.families import family_named

    with HFDirWriter(out_dir, overwrite=overwrite, tool=tool) as out:
        for name, tensor in family_named(model.arch.family).checkpoint_stream(tensors):
            out.add(name, tensor)
        out.copy_side_files(side_files_from)
    from remax_megatron.models.families.deepseek_moe import say_mtp_not_written

    say_mtp_not_written(model.arch, out_dir)


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

    def __init__(
        self, model, dtype: torch.dtype | None = None, bucket_mb: float = 256.0, groups: ProcessGroups | None = None
    ):
        groups = groups or ProcessGroups.current()  # `model`'s layout: the actor's groups
        if not bucket_mb > 0:
            raise ValueError(f"export bucket size {bucket_mb!r} MiB must be > 0 (rollout.sync_bucket_mb)")
        self.model, self.mapping = model, (mapping := mapping_for(model))
        self.params = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        from remax_megatron.models.lora import lora_modules  # megatron-core: not at import (start-up checks)

        self._lora = lora_modules(model)  # adapted weights go out merged: HF tensors only, no adapters
        first = next(iter(self.params.values()))
        self.plan = _plan_buckets(mapping, int(bucket_mb * 2**20 / (dtype or first.dtype).itemsize))
        self.me = (groups.pp_rank, groups.tp_rank)
        self.group = groups.mp if mapping.tp * mapping.pp > 1 else None
        _, _, self.ep_rank, _ = expert_layout(model)
        self.ep_group = groups.ep if mapping.ep > 1 else None
        self._gathered: dict[str, torch.Tensor] = {}  # this bucket's experts of the other EP ranks
        self._ep_buffer: torch.Tensor | None = None
        # The buffers live where the group's collectives run (the current GPU under NCCL).
        self.dtype = dtype or first.dtype
        self.device = comm_device(self.group) if self.group is not None else first.device
        self._source_of: dict[tuple[int, int], int] | None = None
        self._receive: list[torch.Tensor] | None = None  # per TP rank, flat
        self._merged: list[torch.Tensor] = []  # flat, HF-shaped views per bucket (two: overlap)

    def _local(self, spec: ParamSpec) -> torch.Tensor:
        """This rank's shard of `spec`: a live parameter, or an expert another EP rank sent."""
        if spec.megatron in self._gathered:
            return self._gathered[spec.megatron]
        name = local_param_name(self.model, self.mapping, spec, self.params)
        if name in self._lora:
            # W + (alpha/r) B A of this TP shard, in fp32; the caller casts once (to the output dtype).
            return self._lora[name].merged_weight()
        return self.params[name].detach()

    def _broadcast(self, spec: ParamSpec) -> bool:
        """Whether `spec` travels over the model-parallel group: not when every rank of it already holds
        the same tensor (PP = 1 and replicated over TP)."""
        return self.group is not None and (self.mapping.pp > 1 or self.mapping.split(spec) > 1)

    def release(self) -> None:
        """Free the buffers (the next export allocates them again)."""
        self._receive = self._ep_buffer = None
        self._merged = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket

    def buckets(
        self, overlap: bool = False, destination: Callable[[str], torch.Tensor | None] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One export, bucket by bucket: [(hf_name, tensor)] as views into a reused flat buffer.

        The views are valid until the next bucket is requested (overlap=False), or until the one after
        it (overlap=True: while the caller loads bucket k, a thread exports bucket k + 1 into a second
        buffer, so the export's broadcasts and merges run beside the caller's work; one more bucket of
        memory). The rollout sync hands each bucket to the engine as it is (no further copy).

        destination: hf_name -> the tensor to write that HF tensor into (a colocated engine's own
        parameter), or None; asked once per name when the export starts. A name whose destination has
        the HF shape and the export's dtype and device is written there and yielded as that very
        tensor, skipping the buffer (the engine then has nothing to copy). A bucket's copies run as one
        torch._foreach_copy_ (a few kernels on CUDA instead of one or three per tensor).
        """
        mapping = self.mapping
        direct = self._destinations(destination) if destination is not None else {}
        size = max(_merged_numel(mapping, specs, skip=direct) for _, specs in self.plan)
        while size and len(self._merged) < (2 if overlap and len(self.plan) > 1 else 1):
            self._merged.append(torch.empty(size, dtype=self.dtype, device=self.device))
        merged = self._merged or [None]
        if self.group is not None and self._receive is None:
            self._receive = [
                torch.empty(
                    max(_sent_numel(mapping, specs, t) for _, specs in self.plan), dtype=self.dtype, device=self.device
                )
                for t in range(mapping.tp)
            ]
        if self.group is not None and self._source_of is None:
            self._source_of = _source_ranks(self.group, *self.me)
        if not overlap or len(self.plan) == 1:
            for stage, specs in self.plan:
                yield self._export(stage, specs, merged[0], direct)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-export") as pool:
            pending = pool.submit(self._export, *self.plan[0], merged[0], direct)
            for k in range(len(self.plan)):
                bucket = pending.result()
                if k + 1 < len(self.plan):  # into the buffer of bucket k - 1, which the caller is done with
                    pending = pool.submit(self._export, *self.plan[k + 1], merged[(k + 1) % len(merged)], direct)
                yield bucket

    def _destinations(self, destination: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """The HF names this export writes straight into `destination`'s tensors (shape, dtype, device match)."""
        out = {}
        for _, specs in self.plan:
            for spec in specs:
                for name in spec.hf:
                    target = destination(name)
                    if (
                        target is not None
                        and tuple(target.shape) == tuple(self.mapping.hf_shape(name))
                        and target.dtype == self.dtype
                        and target.device == self.device
                    ):
                        out[name] = target
        return out

    @torch.no_grad()
    def _export(
        self,
        stage: int,
        specs: list[ParamSpec],
        merged: torch.Tensor | None,
        direct: dict[str, torch.Tensor] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """One bucket: its shards broadcast from `stage` (and gathered over EP), merged into HF tensors that
        are views of `merged` or the tensors `direct` names."""
        mapping, direct = self.mapping, direct or {}
        if self.ep_group is not None and self.me[0] == stage:
            self._gather_experts(specs)
        shards = (
            self._receive_bucket(stage, specs)
            if self.group is not None
            else {s.megatron: [self._local(s)] for s in specs}
        )
        bucket, copies, offset = [], [], 0
        for spec in specs:
            if spec.fp32:  # its own float32 tensor, not a view of the bucket's buffer (TensorRule.fp32)
                bucket += [
                    (name, tensor.to(torch.float32, copy=True))
                    for name, tensor in mapping.merge_shards(spec, shards[spec.megatron])
                ]
                continue
            out = []
            for name in spec.hf:
                if name in direct:
                    out.append(direct[name])
                    continue
                shape = mapping.hf_shape(name)
                out.append(merged[offset : offset + math.prod(shape)].view(shape))
                offset += out[-1].numel()
            merged_shards = mapping.merge_shards(spec, shards[spec.megatron], out=out, copies=copies)
            for (name, tensor), view in zip(merged_shards, out):
                if tensor is not view:  # replicated: returned as received
                    copies.append((view, tensor))
                bucket.append((name, view))
        if copies:
            torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
        return bucket

    def _receive_bucket(self, stage: int, specs: list[ParamSpec]) -> dict[str, list[torch.Tensor]]:
        """Every TP rank of `stage` broadcasts its shards of `specs` over the model-parallel group.

        Returns megatron name -> the TP shards in rank order (views into the receive buffers).
        """
        shards: dict[str, list[torch.Tensor]] = {s.megatron: [] for s in specs}
        for spec in specs:
            if not self._broadcast(spec):
                shards[spec.megatron].append(self._local(spec))
            elif spec.fp32:  # travels on its own, uncast (TensorRule.fp32: a replicated tensor, from TP rank 0)
                shards[spec.megatron].append(self._broadcast_fp32(stage, spec))
        specs = [s for s in specs if self._broadcast(s) and not s.fp32]
        for t in range(self.mapping.tp):
            sent = [s for s in specs if _sends(self.mapping, s, t)]
            if not sent:
                continue
            flat, offset = self._receive[t][: _sent_numel(self.mapping, specs, t)], 0
            for spec in sent:
                shape = self.mapping.shard_shape(spec)
                view = flat[offset : offset + math.prod(shape)].view(shape)
                if self.me == (stage, t):
                    view.copy_(self._local(spec))  # casts to the output dtype before sending
                shards[spec.megatron].append(view)
                offset += view.numel()
            dist.broadcast(flat, src=self._source_of[stage, t], group=self.group)
        return shards

    def _broadcast_fp32(self, stage: int, spec: ParamSpec) -> torch.Tensor:
        """A replicated float32 tensor of `stage` (TP rank 0's copy) to the whole model-parallel group."""
        assert self.mapping.split(spec) == 1, f"{spec.megatron}: float32 export of a split tensor"
        if self.me == (stage, 0):
            tensor = self._local(spec).to(self.device, torch.float32, copy=True)
        else:
            tensor = torch.empty(self.mapping.shard_shape(spec), dtype=torch.float32, device=self.device)
        dist.broadcast(tensor, src=self._source_of[stage, 0], group=self.group)
        return tensor

    def _gather_experts(self, specs: list[ParamSpec]) -> None:
        """Every EP rank of this stage broadcasts its experts among `specs` (its expert-TP shards) over its
        expert-parallel group; afterwards `_local` finds every expert of the bucket on every rank."""
        mapping, experts = self.mapping, [s for s in specs if s.expert is not None]
        self._gathered = {}
        if not experts:
            return
        need = max(_ep_numel(mapping, specs) for _, specs in self.plan)
        if self._ep_buffer is None or self._ep_buffer.numel() < need:
            self._ep_buffer = torch.empty(need, dtype=self.dtype, device=self.device)
        offset = 0
        for k in range(mapping.ep):
            theirs = [s for s in experts if mapping.owns(s, k)]
            size = sum(math.prod(mapping.shard_shape(s)) for s in theirs)
            if not size:
                continue
            flat = self._ep_buffer[offset : offset + size]
            views, at = [], 0
            for spec in theirs:
                shape = mapping.shard_shape(spec)
                views.append(flat[at : at + math.prod(shape)].view(shape))
                at += views[-1].numel()
                if k == self.ep_rank:
                    views[-1].copy_(self._local(spec))
            dist.broadcast(flat, src=dist.get_global_rank(self.ep_group, k), group=self.ep_group)
            if k != self.ep_rank:
                self._gathered.update({s.megatron: v for s, v in zip(theirs, views)})
            offset += size


def _sends(mapping: WeightMapping, spec: ParamSpec, tp_rank: int) -> bool:
    """A tensor split over TP is sent by every TP rank; one that is not (replicated, or an expert at
    etp = 1, which every TP rank holds whole) by TP rank 0 only."""
    return mapping.split(spec) > 1 or tp_rank == 0


def _ep_numel(mapping: WeightMapping, specs: list[ParamSpec]) -> int:
    """Elements of the expert shards (one expert-TP shard of every expert) of a bucket of `specs`."""
    return sum(math.prod(mapping.shard_shape(s)) for s in specs if s.expert is not None)


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


def _merged_numel(mapping: WeightMapping, specs: list[ParamSpec], skip=()) -> int:
    """Elements of the HF tensors of `specs` (less those named in `skip`: written elsewhere)."""
    return sum(math.prod(mapping.hf_shape(n)) for s in specs for n in s.hf if n not in skip)


def _sent_numel(mapping: WeightMapping, specs: list[ParamSpec], tp_rank: int) -> int:
    """Elements TP rank `tp_rank` sends for a bucket of `specs` (at most: those that travel)."""
    return sum(math.prod(mapping.shard_shape(s)) for s in specs if _sends(mapping, s, tp_rank))


def _source_ranks(group, pp_rank: int, tp_rank: int) -> dict[tuple[int, int], int]:
    """Global rank of every (pp_rank, tp_rank) of the model-parallel group (one tiny all-gather)."""
    mine = torch.tensor([pp_rank, tp_rank, dist.get_rank()], dtype=torch.long, device=comm_device(group))
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return {(p, t): r for p, t, r in (row.tolist() for row in table)}
