"""Train/rollout memory handoff, for an actor and a rollout engine that share GPUs.

    handoff = TrainStateOffload(ddp_actor, optimizer)   # actor.offload_during_rollout: true
    with handoff.offloaded():        # params, grads and optimizer state leave the GPU
        rollouts = engine.generate(...)
    # back, bitwise; the engine sleeps while the actor trains

It works on storages, not modules: every distinct storage behind the actor's
parameters (megatron's DDP param buffer under the DistributedOptimizer, or one
per parameter), its DDP grad buffers and the optimizer's state (Adam moments,
fp32 main weights) is copied into a host buffer (page-locked on CUDA, allocated once
and reused) and resized to zero bytes; reload resizes it back and copies.
Every view into a storage (param.main_grad into the grad buffer, parameters
into the param buffer) stays valid, so nothing is re-wired and the round trip
is bitwise. Grad buffers are dropped rather than copied: every update zeroes
them first. On CPU the "host" is the same memory, so offload frees nothing
there; the same code runs for the tests.

`phase_memory` gives the memory metrics of a phase: on CUDA the peak allocated
in the phase (`memory/peak_gib_<phase>`), on CPU the process RSS at its end
(`memory/rss_gib_<phase>`).

`keep_freed_host_memory` (CPU runs): glibc's malloc gives every allocation above
32 MiB (logits tiles, vocab grads, weight-sync buckets) fresh pages from mmap and
returns them on free, so each step page-faults its working set in again: 270k-560k
minor faults a step on the 60M benchmark model, about 0.5-1 s of a 7.5 s step. With
mmap off and trimming above 1 GiB, freed memory is reused; the RSS then stays at
its peak (what a caching allocator does on GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch

GIB = 2**30


class TrainStateOffload:
    """Offload/reload of the actor's params, grads and optimizer state (see module docstring)."""

    def __init__(self, ddp_model, optimizer, enabled: bool = True):
        ddp_config = getattr(ddp_model, "ddp_config", None)
        for flag in ("use_megatron_fsdp", "reuse_grad_buf_for_mxfp8_param_ag", "nccl_ub"):
            # These share or register the buffers this class frees; it would zero live params.
            if enabled and getattr(ddp_config, flag, False):
                raise ValueError(f"actor.offload_during_rollout does not work with megatron DDP's {flag}")
        self.ddp_model, self.optimizer, self.enabled = ddp_model, optimizer, enabled
        self._host: dict[int, torch.Tensor] = {}  # key -> host copy (kept between steps)
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []  # grad storages and their sizes
        self._saved: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, size, host key
        self.offloaded_bytes = 0

    def _storages(self) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
        """(storages to keep, grad storages to drop), each distinct and non-empty."""
        grads = [b.grad_data for b in _ddp_buffers(self.ddp_model) if b.grad_data is not None]
        kept = list(self.ddp_model.module.parameters()) + list(self.optimizer.state_tensors())
        seen: set[int] = set()

        def distinct(tensors):
            out = []
            for t in tensors:
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out.append(storage)
            return out

        dropped = distinct(grads)  # first: a grad buffer is never also "kept"
        return distinct(kept), dropped

    @torch.no_grad()
    def offload(self) -> None:
        if not self.enabled or self._saved or self._dropped:
            return
        kept, dropped = self._storages()
        # Keyed by position and size: stable from step to step once Adam has created its state.
        keys = {(i, s.nbytes()) for i, s in enumerate(kept)}
        for key in [k for k in self._host if k not in keys]:
            _free_host(self._host.pop(key))
        for i, storage in enumerate(kept):
            size = storage.nbytes()
            key = (i, size)
            host = self._host.get(key)
            if host is None:
                host = self._host[key] = _host_buffer(size, pinned=storage.is_cuda)
            host.copy_(_bytes(storage), non_blocking=storage.is_cuda)
            self._saved.append((storage, size, key))
        if any(s.is_cuda for s, _, _ in self._saved):
            torch.cuda.synchronize()  # the copies must land before the storages go
        for storage, _, _ in self._saved:
            storage.resize_(0)
        for storage in dropped:
            self._dropped.append((storage, storage.nbytes()))
            storage.resize_(0)
        self.offloaded_bytes = sum(s for _, s, _ in self._saved) + sum(s for _, s in self._dropped)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the blocks to the engine, not just to torch's cache

    @torch.no_grad()
    def reload(self) -> None:
        for storage, size, key in self._saved:
            storage.resize_(size)
            _bytes(storage).copy_(self._host[key], non_blocking=storage.is_cuda)
        for storage, size in self._dropped:
            storage.resize_(size)
            _bytes(storage).zero_()
        if any(s.is_cuda for s, _, _ in self._saved):
            torch.cuda.synchronize()
        self._saved, self._dropped = [], []

    @contextlib.contextmanager
    def offloaded(self):
        self.offload()
        try:
            yield
        finally:
            self.reload()


def _host_buffer(size: int, pinned: bool) -> torch.Tensor:
    """A host buffer of `size` bytes; `pinned`: page-locked in place with cudaHostRegister (torch's
    pinned allocator would round it up to a power of two: up to 2x the host memory)."""
    host = torch.empty(size, dtype=torch.uint8)
    if pinned and int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)) == 0:
        host.is_registered = True  # copies from it are truly asynchronous; unregister before freeing
    return host


def _free_host(host: torch.Tensor) -> None:
    if getattr(host, "is_registered", False):
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _ddp_buffers(ddp_model) -> list:
    return list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))


def keep_freed_host_memory() -> bool:
    """CPU runs on glibc: freed memory stays in the process for reuse (module docstring). Returns
    whether it was set; a no-op with CUDA (host buffers there are pinned and allocated once) and
    on other C libraries. Affects allocations made after the call."""
    if torch.cuda.is_available() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: mallopt's parameter numbers are glibc's
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, GIB))


@contextlib.contextmanager
def phase_memory(name: str, record: dict):
    """Memory metrics of the phase run inside (see module docstring) into `record`."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    yield
    if cuda:
        record[f"memory/peak_gib_{name}"] = torch.cuda.max_memory_allocated() / GIB
    else:
        import psutil

        record[f"memory/rss_gib_{name}"] = psutil.Process().memory_info().rss / GIB
