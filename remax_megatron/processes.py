"""How a rank stops, and its child processes die with it.

    flag = preemption_flag()     # train.main, first: stop signals set a flag (PreemptionFlag)
    children_die_with_parent()   # train.main, before anything forks

megatron's checkpoint writer forks one process per write bucket. Killed mid-save (SIGKILL of the
rank, or of the whole job), a rank left them behind: re-parented to init, hundreds of MB each,
still writing, and deaf to SIGTERM, because a forked child keeps its parent's Python signal
handlers (the trainer's stop flag). So every process this one forks, in the child right after
the fork:

- gets SIGKILL when this process dies (Linux PR_SET_PDEATHSIG; checked against a parent that died
  before the call);
- ignores SIGTERM, SIGUSR1 and SIGINT instead of running the trainer's handlers: stopping is the
  rank's decision (a SLURM step-wide SIGTERM, torchrun's or a terminal's signal to the process
  group must not kill a writer in the middle of the save the signal asks for), and the child
  dies with its rank either way;
- closes the run's directory locks (run_lock.HELD_FDS): an inherited descriptor would keep the
  lock of a dead run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from remax_megatron.launch import report_error
from remax_megatron.run_lock import HELD_FDS, release_all

PR_SET_PDEATHSIG = 1
# Signals that stop a run at a step boundary with a checkpoint (PreemptionFlag); children ignore them.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_installed = False
_forking_pid = 0  # set just before each fork; the child reads its copy


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux; False elsewhere).
    The parent is the thread that forked it: fork from the main thread."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _forked_child() -> None:
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != _forking_pid:  # the parent died before the line above took effect
        os._exit(1)
    for sig in STOP_SIGNALS:  # SIGINT last: tests/launch/test_run_ownership.py reads it as "hook done"
        signal.signal(sig, signal.SIG_IGN)
    for fd in list(HELD_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    HELD_FDS.clear()


def children_die_with_parent() -> None:
    """Install the fork hook (once per process)."""
    global _installed
    if _installed:
        return
    os.register_at_fork(before=_before_fork, after_in_child=_forked_child)
    _installed = True


class PreemptionFlag:
    """SIGTERM / SIGUSR1 (a scheduler's stop and its warning) and a first SIGINT (Ctrl-C) only set a
    flag: the loop stops at the next step boundary, saves and exits 0. A second SIGINT is a user who
    will not wait for that: one line, exit 130 at once (the newest complete checkpoint stays; the
    unfinished save's directory is removed by the next run).

    One per process (preemption_flag()), installed first thing by train.main, so a signal that
    arrives during start-up is kept until the first step is done."""

    def __init__(self):
        self.requested, self.signal_name, self.signum = False, "", 0
        self.interrupts = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                _stop_now()
        self.requested, self.signal_name, self.signum = True, signal.Signals(signum).name, int(signum)


_flag: PreemptionFlag | None = None


def preemption_flag() -> PreemptionFlag:
    """This process's flag (its handlers installed on the first call)."""
    global _flag
    if _flag is None:
        _flag = PreemptionFlag()
    return _flag


def _stop_now() -> None:
    release_all()
    report_error(
        "error: stopped by a second SIGINT, without saving: the newest complete checkpoint stays; rerun "
        "with checkpoint.resume=auto to continue from it",
        printer=os.environ.get("RANK", "0") == "0",
        same_on_every_rank=True,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)
