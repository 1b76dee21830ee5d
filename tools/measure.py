"""Time one callable and the memory its first call adds, on CPU or CUDA (tools/bench_*.py).

first_ms, peak_mib = first_call(step, device)    # the first call: its time and peak memory added
times_ms = repeat_ms(step, device, repeats)       # later calls, synchronised around each
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def first_call(step, device: torch.device) -> tuple[float, float]:
    """Run step() once -> (its milliseconds, the peak memory it added in MiB). CUDA: the caching allocator's
    peak above what was allocated before; CPU: the process's resident high-water mark (reset first) above its
    resident size before (Linux /proc)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        base = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    step()
    synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _status_kib("VmHWM") * 1024
    return ms, (peak - base) / 2**20


def repeat_ms(step, device: torch.device, repeats: int) -> list[float]:
    """step() `repeats` times, each timed between device synchronisations -> milliseconds per call."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times
