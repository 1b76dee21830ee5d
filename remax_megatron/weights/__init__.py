"""HF <-> Megatron weights: one mapping; load into shards; export full tensors.

Names are imported on first use: reading a checkpoint's headers (hf_io) does not import megatron-core,
so start-up checks stay fast.
"""

from remax_megatron.lazy import lazy_exports

_EXPORTS = {
    "HFCheckpointReader": "remax_megatron.weights.hf_io",
    "WeightMapping": "remax_megatron.weights.mapping",
    "export_hf_weights": "remax_megatron.weights.export",
    "load_hf_weights": "remax_megatron.weights.load",
    "write_hf_dir": "remax_megatron.weights.hf_io",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
