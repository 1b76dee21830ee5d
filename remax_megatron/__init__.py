"""remax-megatron: ReMax RLHF on megatron-core, SPMD under torchrun."""

__version__ = "0.1.0"
