"""The job launcher: torchrun whose stop signals reach the workers and whose exit code is theirs.

    python -m remax_megatron.launch --nproc_per_node=2 -m remax_megatron.train --config configs/tiny_cpu.yaml
    (torchrun's arguments, unchanged; launch/torchrun.sh and launch/slurm/remax.sbatch run it)

It is torchrun (`torch.distributed.run`: same arguments, same elastic agent, same rendezvous)
with three differences, each a fix of what plain torchrun does to a job that must stop cleanly:

- SIGTERM, SIGUSR1 (a scheduler's stop and its warning) and SIGINT (Ctrl-C) sent to the launcher
  are forwarded to the workers and the launcher then waits for them as long as they take: each
  worker finishes its step, saves a checkpoint and exits 0, and so does the job; a second SIGINT,
  forwarded too, makes the workers stop at once (exit 130). Plain torchrun dies on SIGUSR1 (exit
  138) leaving its workers training, and on SIGTERM or SIGINT signals the workers, kills them 30 s
  later (`--shutdown-timeout`) whether their checkpoint is written or not, then exits 1 with a
  traceback.
- The exit code is the workers': the first failed rank's (2 when the input was refused), and the
  launcher prints that worker's one-line error (`report_error`, through torch's per-worker reply
  file) instead of torchrun's ~35-line report. A worker killed by a signal is named in one line
  (exit 128 + the signal's number); it is the
  cause even when its peers also failed (their "Connection reset by peer" comes from its death),
  and the workers the agent itself stopped after the first failure are never named.
- The workers get REMAX_LAUNCHER=1, so they know no kill grace is running after a stop signal.

SIGHUP and SIGQUIT keep torchrun's handling (forwarded; workers killed after the grace).
Torch's own launcher log lines are hidden unless LOGLEVEL is set (e.g. LOGLEVEL=WARNING).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

# At import, not in the signal handler: a second signal arriving while the first handler imported it
# re-entered a half-initialised module (a quick second Ctrl-C gave a traceback).
import psutil

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
LAUNCHER_ENV = "REMAX_LAUNCHER"
ONE_LINE = "remax_one_line"  # marks a reply file written by report_error


def report_error(line: str, printer: bool, same_on_every_rank: bool) -> None:
    """A worker's one-line error, shown once for the job.

    Under this launcher the worker leaves it in torch's per-worker reply file
    (TORCHELASTIC_ERROR_FILE) and the launcher prints the failed rank's line: the first rank to exit
    gets its peers stopped by the agent, perhaps before the `printer` rank got to print (a CI run saw
    exit 2 and no line). Every rank holding the line writes it. Elsewhere (python, plain torchrun)
    the `printer` rank prints it.
    """
    reply_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(LAUNCHER_ENV) == "1" and reply_file:
        if printer or same_on_every_rank:
            with open(reply_file, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time()), ONE_LINE: True}, f)
    elif printer:
        print(line, file=sys.stderr, flush=True)


def _workers() -> list[int]:
    """The pids of this process's children: the elastic agent starts every worker directly."""
    return [child.pid for child in psutil.Process().children(recursive=False)]


def _forward(signum, _frame) -> None:
    """SIGTERM / SIGUSR1 / SIGINT: hand it to every worker; the agent keeps waiting for them to exit."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    workers = _workers()
    if not workers:  # still in the rendezvous: nothing was started, nothing to save
        raise SignalException(f"{signal.Signals(signum).name} before the workers started", signal.Signals(signum))
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _without_ours(signals: str) -> str:
    """torchrun's --signals-to-handle less SIGTERM, SIGUSR1 and SIGINT (ours); SIGHUP, SIGQUIT stay its."""
    ours = {sig.name for sig in FORWARDED}
    return ",".join(s.strip() for s in signals.split(",") if s.strip() and s.strip() not in ours)


def job_exit(failures: dict, stopped_by_agent: set[int] = frozenset()) -> tuple[int, str | None]:
    """(exit code, line to print) for torchrun's failures {global rank: ProcessFailure}.

    The agent records the workers it stopped after the first failure (its SIGTERM, SIGKILL after the
    grace) as failures too; the cause is among the others. There a rank killed by a signal comes
    first: its peers' errors are its consequence (gloo's "Connection reset by peer") and may be
    collected in the same poll. Otherwise the lowest failed rank's exit code and the line left by
    `report_error` (None if no rank left one: the traceback is on stderr).
    """
    first = {r: f for r, f in failures.items() if f.pid not in stopped_by_agent} or failures
    killed = {r: f for r, f in first.items() if f.exitcode < 0}
    if killed:
        rank, failure = min(killed.items())
        return 128 - failure.exitcode, f"error: rank {rank} (pid {failure.pid}) died from {failure.signal_name()}"
    failed = {r: f for r, f in first.items() if f.exitcode > 0}
    # a rank the agent stopped may have written its line before (the reporting rank of a reward
    # error, whose peers exit at once): the first failures' lines come first, then theirs
    lines = [
        f.message for group in (first, failures) for _, f in sorted(group.items()) if f.error_file_data.get(ONE_LINE)
    ]
    return (failed[min(failed)].exitcode if failed else 1), (lines[0] if lines else None)


def _remember_agent_stops() -> set[int]:
    """The pids torchrun's agent signals when it closes the workers (the only caller of
    SubprocessHandler.close); a torch without that class leaves the set empty."""
    stopped: set[int] = set()
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    except ImportError:
        return stopped
    close = SubprocessHandler.close

    def close_and_remember(self, death_sig=None):
        stopped.add(self.proc.pid)
        return close(self, death_sig)

    SubprocessHandler.close = close_and_remember
    return stopped


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import DistNetworkError, run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = sys.argv[1:] if argv is None else argv
    # torch's launcher logs (its OMP_NUM_THREADS banner, "failed (exitcode: 2) local_rank: 0 ...")
    # repeat what the workers and this launcher say in one line; LOGLEVEL=WARNING shows them again.
    level = os.environ.get("LOGLEVEL", "CRITICAL")
    for name, log in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(log, logging.Logger):
            log.setLevel(level)
    os.environ[LAUNCHER_ENV] = "1"
    args = torchrun.parse_args(argv)
    args.signals_to_handle = _without_ours(args.signals_to_handle)
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node not in ("1", 1):
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets (without its banner)
    for sig in FORWARDED:
        signal.signal(sig, _forward)
    stopped_by_agent = _remember_agent_stops()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        code, line = job_exit(e.failures, stopped_by_agent)
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.exit(code)
    except SignalException as e:
        print(f"error: launcher stopped by {e.sigval.name}; the workers were stopped", file=sys.stderr, flush=True)
        sys.exit(128 + int(e.sigval))
    except DistNetworkError as e:  # the agent's rendezvous store, before any worker started
        if "EADDRINUSE" not in str(e):
            raise
        from remax_megatron.parallel.layout import port_in_use

        print(f"error: {port_in_use(str(args.master_port))}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
