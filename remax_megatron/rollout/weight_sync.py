"""Bucketed weight sync: the actor's exported HF tensors streamed into the rollout engine.

    sync = WeightSync(engine, actor_module, bucket_mb=cfg.rollout.sync_bucket_mb)
    stats = sync()   # {"bytes": ..., "seconds": ..., "buckets": ...}, every step

The actor's exporter (weights/export.py) yields every full HF tensor on every
rank of the actor's TP x PP group, bucket by bucket, in the engine dtype. Every
rank runs an engine that needs all of them: the native engine is a full replica
per rank, and each rank of a vLLM engine passes full HF tensors to vLLM's
in-place reload, which keeps that rank's shard. So nothing more is sent between
ranks here: the export's buckets stream into ONE `engine.update_weights` call,
produced lazily while the engine loads them.

`sync_weights(engine, stream, bucket_mb)` does the same for any (name, tensor)
stream: a BucketPacker copies (and casts) each tensor as it arrives into one
reused buffer in the engine's dtype on the engine's device (peak extra memory:
one bucket, or one tensor when a single tensor is larger).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from remax_megatron.rollout.engine import RolloutEngine
from remax_megatron.sizes import round_up
from remax_megatron.weights.export import HFExporter

_ALIGN_BYTES = 256  # each view starts on a 256-byte boundary (vectorised copies on GPU)


class BucketPacker:
    """Packs a (name, tensor) stream into one reused buffer of `bucket_bytes` (in the target dtype).

        for bucket in packer.pack(named_tensors):   # hand each bucket on before asking for the next
            ...
        packer.put(name, tensor)      # copies (and casts) now: the source may be reused after

    A tensor larger than the bucket goes alone into a buffer grown to fit it.
    """

    def __init__(self, bucket_bytes: int, dtype: torch.dtype, device: torch.device):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size {bucket_bytes} bytes must be > 0 (rollout.sync_bucket_mb)")
        self.bucket_bytes, self.dtype, self.device = int(bucket_bytes), dtype, torch.device(device)
        self.itemsize = dtype.itemsize
        self.align = max(1, _ALIGN_BYTES // self.itemsize)
        self._buffer: torch.Tensor | None = None
        self._views: list[tuple[str, torch.Tensor]] = []
        self._used = 0  # elements, aligned

    def _padded(self, numel: int) -> int:
        return round_up(numel, self.align)

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` joins the current bucket (always true for an empty bucket)."""
        return not self._views or (self._used + self._padded(tensor.numel())) * self.itemsize <= self.bucket_bytes

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` (cast to the target dtype) into the bucket; call `take` first unless it `fits`."""
        assert self.fits(tensor), "take() the full bucket before putting a tensor that does not fit"
        size = self._padded(tensor.numel())
        need = max(self._used + size, self.bucket_bytes // self.itemsize)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None  # free before growing (only happens for an empty bucket or the first put)
            self._buffer = torch.empty(need, dtype=self.dtype, device=self.device)
        view = self._buffer[self._used : self._used + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        self._views.append((name, view))
        self._used += size

    def pack(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The stream as full buckets; load each before asking for the next."""
        for name, tensor in weights:
            if not self.fits(tensor):
                yield self.take()
            self.put(name, tensor)
        if self._views:
            yield self.take()

    def take(self) -> list[tuple[str, torch.Tensor]]:
        """The bucket's (name, view) pairs; the views alias the buffer: load them before the next put."""
        views, self._views, self._used = self._views, [], 0
        return views

    def release(self) -> None:
        self._buffer, self._views, self._used = None, [], 0


def sync_weights(
    engine: RolloutEngine,
    weights: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float,
    packer: BucketPacker | None = None,
) -> dict:
    """Stream (hf_name, full tensor) pairs into `engine` in buckets of `bucket_mb` MiB.

    Returns {"bytes": bytes delivered (engine dtype), "seconds": wall time of the
    whole sync including the export that produces `weights`, "buckets": count}.
    Every rank calls it with its own engine and the same export stream. `packer`: a
    BucketPacker to reuse (kept, not released); by default one for this call.
    """
    if not bucket_mb > 0:
        raise ValueError(f"rollout.sync_bucket_mb={bucket_mb!r} must be > 0")
    own_packer = packer is None
    if own_packer:
        packer = BucketPacker(int(bucket_mb * 2**20), engine.dtype, engine.device)
    try:
        return load_buckets(engine, packer.pack(weights))
    finally:
        if own_packer:
            packer.release()


def load_buckets(engine: RolloutEngine, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict:
    """One weight update of `engine`: the bucket stream, consumed by ONE `update_weights` call.

    Stats as sync_weights."""
    start, stats = time.perf_counter(), {"bytes": 0, "buckets": 0}

    def counted():
        for bucket in buckets:
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            stats["buckets"] += 1
            yield bucket

    engine.update_weights(counted())
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return {**stats, "seconds": time.perf_counter() - start}


class WeightSync:
    """The trainer's per-step sync: `model`'s export, in the engine dtype, into `engine`.

        sync = WeightSync(engine, actor_module, bucket_mb=cfg.rollout.sync_bucket_mb)
        stats = sync()        # every step

    The exporter casts to the engine dtype before sending (bf16 engine: half the bytes of an
    fp32 actor) and its buckets, already in the engine's dtype and on its device, go to the
    engine as they are (a packer repacks them only when the devices differ). Colocated on one
    device (the native engine, tp1 or not), the export writes each tensor straight into the
    engine's parameter (`engine.weight_destination`), a bucket's copies as one
    torch._foreach_copy_: one device-to-device pass over the bytes, no staging buffer. On CPU the export
    of bucket k + 1 runs in a thread while the engine loads bucket k (HFExporter.buckets(overlap=
    True): two bucket buffers); on CUDA the buckets follow one another (not run on a GPU yet). Buffers are
    kept between syncs on CPU, where fresh pages cost page faults on every sync, and freed
    after each sync on CUDA, where the caching allocator reuses the blocks and training
    needs the memory.
    """

    def __init__(self, engine: RolloutEngine, model, bucket_mb: float, groups=None):
        self.engine, self.bucket_mb = engine, bucket_mb
        self.exporter = HFExporter(model, dtype=engine.dtype, bucket_mb=bucket_mb, groups=groups)
        self.packer = BucketPacker(int(bucket_mb * 2**20), engine.dtype, engine.device)

    def __call__(self) -> dict:
        try:
            if _same_device(self.exporter.device, self.engine.device):
                # CPU: the next bucket is exported (broadcast, merged) while the engine loads this one. An
                # engine that names its parameters (weight_destination) gets them written in place.
                buckets = self.exporter.buckets(
                    overlap=self.exporter.device.type == "cpu",
                    destination=getattr(self.engine, "weight_destination", None),
                )
                return load_buckets(self.engine, buckets)
            return sync_weights(self.engine, self.exporter, self.bucket_mb, packer=self.packer)
        finally:
            if self.exporter.device.type != "cpu":
                self.exporter.release()
            if self.packer.device.type != "cpu":
                self.packer.release()


def _same_device(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
