"""Process groups and the parallel layout."""

from remax_megatron.parallel.layout import ParallelLayout, ProcessGroups, init_distributed

__all__ = ["ParallelLayout", "ProcessGroups", "init_distributed"]
