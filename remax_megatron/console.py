"""What the libraries print in a run, decided in one place (before they are imported)."""

from __future__ import annotations

import os
import sys
import warnings


def quiet_library_warnings(rank: int | None = None) -> None:
    """The one place that decides which library warnings a run shows; call it before megatron-core
    is imported (train.main does). Nothing changes when the user chose with -W / PYTHONWARNINGS.

    megatron-core warns at import and at model build, on every rank: Apex / Transformer Engine
    missing (once per module, five times), "full scope is deprecated" (its own `cuda_graph_scope`
    default, nothing a user set) and CUDA_DEVICE_MAX_CONNECTIONS (meaningless without CUDA); a
    resume adds FutureWarnings of torch's checkpoint API that megatron's dist_checkpointing uses.
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
    # Deprecations inside the checkpoint libraries' own calls (ShardedTensor, load_state_dict): not the user's.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\.core\.dist_checkpointing")
        warnings.filterwarnings("ignore", category=category, module=r"torch\.distributed\.checkpoint")
    if rank != 0:
        warnings.filterwarnings("ignore", module="megatron")
    elif torch.cuda.is_available() and not any(importlib.util.find_spec(m) for m in ("apex", "transformer_engine")):
        warnings.warn("neither Apex nor Transformer Engine is installed: megatron-core uses its local (slower) "
                      "fused-op fallbacks", stacklevel=2)
