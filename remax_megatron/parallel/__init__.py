"""Process groups and the parallel layout."""

from remax_megatron.parallel.layout import ParallelLayout, ProcessGroups, all_reduce_cpu, comm_device, init_distributed

__all__ = ["ParallelLayout", "ProcessGroups", "all_reduce_cpu", "comm_device", "init_distributed"]
