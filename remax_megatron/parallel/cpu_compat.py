"""megatron-core on CPU: the few CUDA assumptions of megatron-core 0.16-0.19 made to run on gloo.

Everything here is inert when CUDA is available: `install()` returns at once,
`redirect_cuda()` is a null context and `forward_backward_func()` hands back
megatron's own schedule untouched. Callers: ParallelLayout.initialize (install,
the per-TP-rank seeds), model construction in models/gpt.py (redirect_cuda) and
models/forward.run_schedule (the schedule). See shared/PITFALLS.md.

What `install()` patches, PROCESS-WIDE and for the rest of the process (never undone; it is
called once per process by ParallelLayout.initialize, on CPU-only machines):

1. `megatron.core.utils.GlobalMemoryBuffer.get_tensor` allocated on the current CUDA device
   (local core attention, sequence-parallel gathers) -> allocates on CPU.
2. `CudaRNGStatesTracker.add/fork` and `tensor_parallel.random._get/_set_cuda_rng_state`
   drive the CUDA generator -> the same named-state bookkeeping on the CPU generator, so
   dropout under `fork()` and activation recompute (which saves and restores the generator
   around the recomputed forward) stay reproducible per TP rank exactly as on GPU.
3. `megatron.core.fusions.fused_softmax.get_default_causal_mask` built its mask with a literal
   `device="cuda"` (inside recomputed functions, where redirect_cuda() does not reach) -> CPU.
4. `torch.cuda.current_device` -> "cpu", `torch.cuda.synchronize` -> no-op and
   `torch.cuda.current_stream` -> a stream whose waits return at once, for EVERY library in the
   process (megatron's RoPE, attention and p2p code place tensors on the current device;
   megatron-core 0.19's `start_grad_sync` always takes the current stream, even without CUDA
   graphs, and fails "Found no NVIDIA driver" on CPU; on a CPU-only torch build all three would
   raise anyway).
5. MoE, the alltoall token dispatcher: it creates a `torch.cuda.Stream()` for its device-to-host
   copies in `__init__`, and its `_maybe_dtoh_and_synchronize` copies the split sizes to the
   host on that stream as numpy arrays -- on CPU they stay tensors, which gloo's
   `all_to_all_single` refuses as split sizes (TypeError). The CPU version turns them into
   numpy arrays at the same point, with no streams.

`install_moe()` (called by ParallelLayout.initialize on every machine, CUDA too): megatron-core
0.16.1's `RouterGatingLinearFunction` reads `te_general_gemm`, which moe_utils defines only when
Transformer Engine imports; without TE the router's forward raised NameError. It is set to None
there (megatron's own fallback: torch.mm in the router dtype). Inert where TE is installed.

`redirect_cuda()` is scoped (a TorchFunctionMode while it is active): tensor factories called
with `device="cuda"` (the pipeline schedules) and `.cuda()` (GPTModel's tied embedding at
PP > 1) stay on CPU, in the schedules and in model construction only.
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


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):  # noqa: ARG001 - megatron's signature
    required = 1
    for s in tensor_shape:
        required *= s
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        self.buffer[(name, dtype)] = buf = torch.empty(required, dtype=dtype)
    return buf[:required].view(*tensor_shape)


_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.tensor,
    torch.arange,
    torch.empty_like,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
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
    mp_random._get_cuda_rng_state = lambda *_args, **_kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *_args, **_kwargs: torch.set_rng_state(state)
    # RoPE, attention and p2p code place tensors on `torch.cuda.current_device()`.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *_a, **_k: None
    # megatron-core 0.19's start_grad_sync waits on the current stream for CUDA-graph events
    torch.cuda.current_stream = lambda *_a, **_k: _CPU_STREAM

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM  # __init__ creates one only while it is None
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize
    _installed = True


_NO_STREAM = object()  # stands for the dispatcher's CUDA side stream on CPU


class _CpuStream:
    """What `torch.cuda.current_stream()` returns on CPU: work is synchronous, so every wait is done."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on CPU: at the dispatcher's device-to-host
    point the split sizes become numpy arrays (host values, as the CUDA version leaves them); nothing
    to synchronise."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def install_moe() -> None:
    """Define moe_utils.te_general_gemm (None) when Transformer Engine did not import; see the docstring."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
