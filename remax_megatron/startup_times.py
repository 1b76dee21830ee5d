"""Where the time from launch to the first step goes (issue 50: a first step that is not a minute).

    clock = StartupClock()            # at the top of train.main
    with clock.part("models"): ...    # each start-up phase, in order
    clock.record(first_step_end)      # the first training record's time/startup_s, time/startup/<part>_s, ...

Launch is the launcher's start: under torchrun (or remax_megatron.launch, which runs torchrun in its own
process) the worker's parent process, else this process; both read from the kernel's process start time
(psutil), so the interpreter's own start and the imports before main count too (`time/startup/launch_s`).
Parts are wall seconds of this rank; rank 0's go into metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import os
import time


def launch_time() -> float:
    """Unix time the run was launched: the torchrun agent's start for a torchrun worker, else this process's."""
    import psutil

    process = psutil.Process()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        parent = process.parent()
        if parent is not None:
            return parent.create_time()
    return process.create_time()


class StartupClock:
    """Wall seconds of the named start-up phases, and the run's launch time."""

    def __init__(self):
        self.launch = launch_time()
        self.parts: dict[str, float] = {"launch": time.time() - self.launch}  # to the top of main
        self.step_start: float | None = None  # the first training step's start
        self.reported = False

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.time() - start

    def step_starts(self) -> None:
        """Called before every training step; the first call is start-up's end."""
        if self.step_start is None:
            self.step_start = time.time()

    def first_record(self) -> dict:
        """After a step: for the run's first step (once), time/startup_s (launch to the step's start), its
        parts (time/startup/<part>_s) and time/launch_to_first_step_s (launch to the step's end, now); else {}."""
        if self.reported or self.step_start is None:
            return {}
        self.reported = True
        out = {
            "time/startup_s": self.step_start - self.launch,
            "time/launch_to_first_step_s": time.time() - self.launch,
        }
        out.update({f"time/startup/{name}_s": seconds for name, seconds in self.parts.items()})
        out["time/startup/other_s"] = out["time/startup_s"] - sum(self.parts.values())  # between the parts
        return out
