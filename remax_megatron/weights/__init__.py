"""HF <-> Megatron weights: one mapping; load into shards; export full tensors."""

from remax_megatron.weights.export import export_hf_weights
from remax_megatron.weights.hf_io import HFCheckpointReader, write_hf_dir
from remax_megatron.weights.load import load_hf_weights
from remax_megatron.weights.mapping import WeightMapping

__all__ = ["HFCheckpointReader", "WeightMapping", "export_hf_weights", "load_hf_weights", "write_hf_dir"]
