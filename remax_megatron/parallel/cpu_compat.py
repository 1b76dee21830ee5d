"""megatron-core on CPU: the few CUDA assumptions of megatron-core 0.16 made to run on gloo.

Everything here is inert when CUDA is available: `install()` returns at once and
`forward_backward_func()` hands back megatron's own schedule untouched. Nothing
else in the package knows about these accommodations (see shared/PITFALLS.md):

1. `GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`
   (local core attention, sequence-parallel gathers) -> allocate on CPU.
2. `CudaRNGStatesTracker.add/fork` drive the CUDA generator -> the same
   named-state bookkeeping on the CPU generator, so dropout under `fork()` stays
   reproducible per TP rank exactly as on GPU.
3. RoPE, attention and p2p code place tensors on `torch.cuda.current_device()`
   and p2p calls `torch.cuda.synchronize()` -> "cpu" and a no-op (on a CPU-only
   torch build both would raise anyway).
4. The pipeline schedules create tensors with a literal `device="cuda"`, and
   GPTModel's constructor moves the tied embedding with `.cuda()` at PP > 1 ->
   inside `redirect_cuda()` (schedules, model construction) those stay on CPU.
5. Activation recompute (`tensor_parallel.checkpoint`) saves and restores the
   CUDA generator's state around the recomputed forward -> the CPU generator's;
   and the softmax's causal mask (built with a literal `device="cuda"`, inside the
   checkpointed function where `redirect_cuda()` does not reach) -> built on CPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def cuda_present() -> bool:
    return torch.cuda.is_available()


class _CpuRNGStatesTracker:
    """Drop-in for megatron's CudaRNGStatesTracker methods, on the CPU generator."""

    @staticmethod
    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @staticmethod
    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required = 1
    for s in tensor_shape:
        required *= s
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        self.buffer[(name, dtype)] = buf = torch.empty(required, dtype=dtype)
    return buf[:required].view(*tensor_shape)


_FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like,
}


class _CudaFactoriesToCpu(TorchFunctionMode):
    """Rewrites `device=cuda` (or a CUDA index) to CPU in tensor factory calls; `t.cuda()` -> t."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func in _FACTORIES and "device" in kwargs:
            dev = kwargs["device"]
            if isinstance(dev, int) or (dev is not None and torch.device(dev).type == "cuda"):
                kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def install() -> None:
    """Patch megatron-core for CPU; a no-op when CUDA is present. Idempotent."""
    global _installed
    if _installed or cuda_present():
        return
    from megatron.core import utils
    from megatron.core.tensor_parallel import random as mp_random

    utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    mp_random.CudaRNGStatesTracker.add = _CpuRNGStatesTracker.add
    mp_random.CudaRNGStatesTracker.fork = _CpuRNGStatesTracker.fork
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # RoPE, attention and p2p code place tensors on `torch.cuda.current_device()`.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    _installed = True


@functools.lru_cache
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron.core.transformer.utils.get_default_causal_mask, on CPU: True above the diagonal."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def model_parallel_seed(seed: int) -> None:
    """megatron's model_parallel_cuda_manual_seed, or its CPU equivalent."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if cuda_present():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # Same seeds as megatron: data-parallel seed shared, model-parallel seed per TP rank.
    torch.manual_seed(seed)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def redirect_cuda():
    """Context in which megatron's literal CUDA placements land on CPU (no-op with CUDA)."""
    return contextlib.nullcontext() if cuda_present() else _CudaFactoriesToCpu()


def forward_backward_func(pp_size: int | None = None):
    """megatron's forward-backward schedule for `pp_size` stages (default: the global PP layout), CPU-safe."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    func = get_forward_backward_func() if pp_size is None else get_forward_backward_func(pp_size, None)
    if cuda_present():
        return func

    @functools.wraps(func)
    def on_cpu(*args, **kwargs):
        with redirect_cuda():
            return func(*args, **kwargs)

    return on_cpu
