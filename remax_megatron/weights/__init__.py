"""HF <-> Megatron weights: one mapping; load into shards; export full tensors.

Names are imported on first use: reading a checkpoint's headers (hf_io) does not import megatron-core,
so start-up checks stay fast.
"""

import importlib

_EXPORTS = {
    "HFCheckpointReader": "remax_megatron.weights.hf_io",
    "WeightMapping": "remax_megatron.weights.mapping",
    "export_hf_weights": "remax_megatron.weights.export",
    "load_hf_weights": "remax_megatron.weights.load",
    "write_hf_dir": "remax_megatron.weights.hf_io",
}


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
