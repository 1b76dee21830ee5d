"""Bucketed weight sync: the actor's exported HF tensors streamed into the rollout engine.

    stats = sync_weights(engine, export_hf_weights(actor), bucket_mb=cfg.rollout.sync_bucket_mb)
    # {"bytes": ..., "seconds": ..., "buckets": ...}

`export_hf_weights` already yields every full HF tensor on every rank of the
actor's TP x PP group (TP all-gather + PP broadcast inside the export). Every
rank runs an engine that needs all of them: the native engine is a full replica
per rank, and each rank of a vLLM engine passes full HF tensors to its model's
`load_weights`, which keeps that rank's shard. So nothing is sent between ranks
here; each rank packs its stream into buckets and hands them to its engine.

A bucket is one contiguous buffer in the engine's dtype on the engine's device
(allocated once and reused: peak extra memory is one bucket, or one tensor
when a single tensor is larger), filled by casting copies; the engine gets it as
a list of (name, view) in ONE `load_weights` call per bucket.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from remax_megatron.rollout.engine import RolloutEngine

_ALIGN_BYTES = 256  # each view starts on a 256-byte boundary (vectorised copies on GPU)


class BucketPacker:
    """Groups a (name, tensor) stream into buckets of at most `bucket_bytes` (in the target dtype)."""

    def __init__(self, bucket_bytes: int, dtype: torch.dtype, device: torch.device):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket size {bucket_bytes} bytes must be > 0 (rollout.sync_bucket_mb)")
        self.bucket_bytes, self.dtype, self.device = int(bucket_bytes), dtype, torch.device(device)
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.align = max(1, _ALIGN_BYTES // self.itemsize)
        self._buffer: torch.Tensor | None = None
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_elems = 0

    def _padded(self, numel: int) -> int:
        return -(-numel // self.align) * self.align

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Queue one tensor; returns a full bucket to load when this tensor does not fit."""
        ready = None
        size = self._padded(tensor.numel())
        if self._pending and (self._pending_elems + size) * self.itemsize > self.bucket_bytes:
            ready = self.flush()
        self._pending.append((name, tensor))
        self._pending_elems += size
        return ready

    def flush(self) -> list[tuple[str, torch.Tensor]] | None:
        """The queued tensors packed into the bucket buffer as (name, view), or None if empty.

        The views alias the reused buffer: load them before the next flush.
        """
        if not self._pending:
            return None
        need = max(self._pending_elems, self.bucket_bytes // self.itemsize)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None
            self._buffer = torch.empty(need, dtype=self.dtype, device=self.device)
        out, offset = [], 0
        for name, tensor in self._pending:
            view = self._buffer[offset:offset + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            out.append((name, view))
            offset += self._padded(tensor.numel())
        self._pending, self._pending_elems = [], 0
        return out

    def release(self) -> None:
        self._buffer, self._pending, self._pending_elems = None, [], 0


def sync_weights(engine: RolloutEngine, weights: Iterable[tuple[str, torch.Tensor]],
                 bucket_mb: float) -> dict:
    """Stream (hf_name, full tensor) pairs into `engine` in buckets of `bucket_mb` MiB.

    Returns {"bytes": bytes delivered (engine dtype), "seconds": wall time of the
    whole sync including the export that produces `weights`, "buckets": count}.
    Every rank calls it with its own engine and the same export stream.
    """
    if not bucket_mb > 0:
        raise ValueError(f"rollout.sync_bucket_mb={bucket_mb!r} must be > 0")
    start = time.perf_counter()
    packer = BucketPacker(int(bucket_mb * 2**20), engine.dtype, engine.device)
    total_bytes, buckets = 0, 0
    engine.begin_weight_update()
    try:
        for name, tensor in weights:
            total_bytes += tensor.numel() * packer.itemsize
            bucket = packer.add(name, tensor)
            if bucket is not None:
                engine.load_weights(bucket)
                buckets += 1
        bucket = packer.flush()
        if bucket is not None:
            engine.load_weights(bucket)
            buckets += 1
    finally:
        packer.release()
    engine.finish_weight_update()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return {"bytes": total_bytes, "seconds": time.perf_counter() - start, "buckets": buckets}
