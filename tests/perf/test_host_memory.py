"""remax_megatron.memory.keep_freed_host_memory: on CPU a step's big temporaries, freed and allocated
again the next step, reuse the process's memory instead of page-faulting fresh pages in (what cost
the 60M benchmark model 0.5-1 s a step). Page-fault counts, not timings; each case in a fresh
interpreter."""

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from remax_megatron.memory import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else False
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # big temporaries (64 and 32 MiB: above glibc's largest mmap threshold), freed at its end
    a = torch.ones(1 << 24); b = torch.ones(1 << 23); c = a[: 1 << 23] * b; return float(c[0])
for _ in range(8):  # the heap settles into its layout (after 3 steps it sometimes still grew by a block)
    step()
before = faults()
for _ in range(8):
    step()
print(kept, faults() - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    kept, faults = r.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_freed_temporaries_are_reused_without_page_faults():
    kept, faults = _faults("default")
    assert kept == "False" and faults > 8 * (64 + 32 + 32) * 256 * 0.9  # every step maps its 128 MiB in again
    kept, faults = _faults("keep")
    assert kept == "True" and faults < 32 * 256  # 8 steps: less than one 32 MiB block faulted in again
