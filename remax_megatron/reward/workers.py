"""Reward functions called in worker processes, each call under a time limit (reward.workers, reward.timeout_s).

    pool = RewardWorkers(functions, workers=4, timeout_s=10.0, timeout_value=0.0)
    total, parts, timed_out = pool.score(batch)    # as RewardFunctions.score, plus the responses that timed out
    pool.close()

In the trainer's process a reward function that hangs (a regex or a symbolic simplification on a hostile
response) stops the run, and one that kills its process (a segfault in an extension, os._exit) ends the rank.
Here each response is its own call, in one of `workers` processes: a call that runs past `timeout_s` is killed
with its worker, a worker that dies is noticed; either way that response scores `timeout_value` (in the total
and in each function's values), and a new worker takes the place of the one that is gone.

One call per response, not per batch: a hang then costs only its response, and the step at most `timeout_s`
more (a batch call that timed out would have to retry its responses one by one under the limit again: twice
the limit). So a function scored here must score each response on its own, as every built-in does; one that
compares the responses of a batch needs reward.workers=0. Totals are summed in the order RewardFunctions sums
them: equal to the in-process scores bit for bit.

A function that raises or returns something unusable still fails the run (RewardError), naming the function
and the prompt the in-process path names. Workers are started with 'spawn' (a fresh interpreter: none of the
rank's torch, CUDA or process-group state), resolve the functions by their spec (a registry name or
`package.module:function`), see no GPU, ignore the stop signals (the rank decides when to stop) and die with
the rank (PR_SET_PDEATHSIG). Linux sends that signal when the *thread* that started the worker exits, so every
worker is started by one thread the pool owns for its lifetime: scoring from a thread that then ends (a test's
time limit, an asynchronous scorer) does not kill the workers it replaced.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import util
from multiprocessing.connection import wait

from remax_megatron.reward.functions import RewardBatch, RewardError, RewardFunction, RewardFunctions, call_checked

START_TIMEOUT_S = 120.0  # a worker resolves the functions (imports their modules) within this, or the run stops
PR_SET_PDEATHSIG = 1  # Linux prctl
# What a worker must not take from the rank: its GPUs, and the variables that make it look like a rank.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


class RewardWorkers:
    """`workers` processes that score responses one call each, every call under `timeout_s` (0: no limit)."""

    def __init__(self, functions: RewardFunctions, workers: int, timeout_s: float = 0.0, timeout_value: float = 0.0):
        assert workers >= 1, workers
        self.functions, self.timeout_s, self.timeout_value = functions, timeout_s, timeout_value
        self.workers = workers
        self._specs = [(fn.spec, fn.options) for fn in functions.functions]
        self._context = mp.get_context("spawn")
        self._slots: list[_Worker] = []  # started by the first score(): a failure to start is a RewardError there
        self._starter: ThreadPoolExecutor | None = None  # the thread that starts every worker (see the docstring)
        # At interpreter exit, before multiprocessing's own clean-up: that one SIGTERMs its children, which
        # workers ignore, then joins them (an exit without close() would wait forever).
        util.Finalize(self, _close, args=(self._slots,), exitpriority=10)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._slots]

    def score(self, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]], list[int]]:
        """The weighted total per response, each function's values, and the indices of the responses whose
        call timed out or whose worker died (scored timeout_value)."""
        try:
            if not self._slots:
                self._open()
            return self._score(batch)
        except BaseException:  # no call left running into the next score (a RewardError stops the run anyway)
            self.close()
            raise

    def _score(self, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]], list[int]]:
        n, functions = len(batch), self.functions.functions
        pending = deque(range(n))
        values: list[list[float] | None] = [None] * n  # per response: one value per function
        errors: dict[int, tuple[int, str, str]] = {}  # response -> (function index, message, where)
        timed_out: list[int] = []
        done = 0
        while done < n:
            for w in self._slots:
                if w.ready and w.task is None and pending:
                    i = pending.popleft()
                    if not w.send(i, batch):  # it died idle: noticed below, the response goes to another
                        pending.appendleft(i)
            busy = [w.deadline for w in self._slots if w.task is not None and w.deadline is not None]
            limit = max(0.0, min(busy) - time.monotonic()) if busy else None
            wait([w.conn for w in self._slots] + [w.process.sentinel for w in self._slots], limit)
            for slot, w in enumerate(self._slots):
                reply, gone = w.receive()
                if reply is not None:
                    i, got, error = reply
                    values[i], done = got, done + 1
                    if error is not None:
                        errors[i] = error
                elif not gone and not w.overdue():
                    continue
                else:  # dead, or its call ran past the limit: the response scores timeout_value
                    i = w.task
                    w.stop()
                    if not w.ready:  # died while loading the functions (its predecessor loaded them)
                        raise RewardError(
                            f"a reward worker exited with code {w.process.exitcode} while loading "
                            f"reward.functions {self.functions.specs}"
                        )
                    if i is not None:
                        timed_out.append(i)
                        values[i], done = [self.timeout_value] * len(functions), done + 1
                    self._slots[slot] = self._start()
        if errors:  # the one the in-process path raises: the first function that fails, on its first response
            i = min(errors, key=lambda j: (errors[j][0], j))
            raise RewardError(errors[i][1], errors[i][2])
        total = [0.0] * n
        parts = {}
        for k, (fn, weight) in enumerate(zip(functions, self.functions.weights)):
            column = [v[k] for v in values]
            parts[fn.spec] = column
            total = [t + weight * v for t, v in zip(total, column)]
        for i in timed_out:  # the response's reward, not each function's value times its weight
            total[i] = self.timeout_value
        return total, parts, sorted(timed_out)

    def close(self) -> None:
        """Ask every worker to exit, kill the ones that do not within a second; idempotent."""
        _close(self._slots)
        if self._starter is not None:  # after the workers: its thread's exit would SIGKILL any left
            self._starter.shutdown()
            self._starter = None

    def _open(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for _ in range(self.workers):
            self._slots.append(self._start())
        for w in self._slots:
            w.wait_ready(deadline)

    def _start(self) -> _Worker:
        if self._starter is None:
            self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remax-reward-starter")
        return self._starter.submit(_Worker, self._context, self._specs, self.timeout_s).result()


def _close(slots: list[_Worker]) -> None:
    for w in slots:
        w.stop(grace_s=1.0)
    slots.clear()


class _Worker:
    """One worker process, its pipe, and the call it is running (task: the response index; deadline)."""

    def __init__(self, context, specs, timeout_s: float):
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, os.getpid(), specs), daemon=True, name="remax-reward-worker"
        )
        self.process.start()
        child.close()  # only the worker holds its end: its death is an EOF here
        self.timeout_s, self.ready, self.task, self.deadline = timeout_s, False, None, None

    def wait_ready(self, deadline: float) -> None:
        while not self.ready:
            if not wait([self.conn, self.process.sentinel], max(0.0, deadline - time.monotonic())):
                raise RewardError(f"a reward worker did not load reward.functions in {START_TIMEOUT_S:.0f} s")
            _, gone = self.receive()
            if gone:
                self.process.join()
                raise RewardError(
                    f"a reward worker exited with code {self.process.exitcode} while loading reward.functions"
                )

    def send(self, i: int, batch: RewardBatch) -> bool:
        """Start the call on response i; False when the worker is gone."""
        try:
            self.conn.send(batch.item(i))
        except OSError:
            return False
        self.task = i
        self.deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        return True

    def receive(self) -> tuple[tuple | None, bool]:
        """(its reply to the call it ran, or None; whether it is gone), without blocking."""
        try:
            if not self.conn.poll():
                return None, not self.process.is_alive()
            message = self.conn.recv()
        except (EOFError, OSError):
            return None, True
        if message[0] == "ready":
            self.ready = True
            return None, False
        if message[0] == "failed":  # could not resolve a function: the start-up check resolved it, so rare
            raise RewardError(f"a reward worker could not load reward.functions: {message[1]}")
        i, self.task, self.deadline = self.task, None, None
        return (i, message[1], message[2]), False

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def stop(self, grace_s: float = 0.0) -> None:
        """Ask it to exit (grace_s > 0: it is idle) or kill it, and reap it: no process is left behind."""
        if grace_s > 0 and self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def _serve(conn, parent: int, specs: list[tuple[str, dict]]) -> None:
    """A worker's loop: resolve the functions, then score one response per message (None: exit). Replies
    ("ready",), ("failed", message), or (None, values, error): values one per function called, error
    (function index, message, where) of the first function that failed, None when all gave a value."""
    # As remax_megatron.processes does for the rank's forked children (not imported: it sits above reward):
    # SIGKILL when the rank dies, and the stop signals ignored (the rank decides when to stop).
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the rank died before the line above took effect
        os._exit(1)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for key in RANK_VARIABLES:
        os.environ.pop(key, None)
    try:
        functions = [RewardFunction(spec, options) for spec, options in specs]
    except Exception as e:  # noqa: BLE001 - any import failure is the one line the rank reports
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the rank closed the pipe or died
            return
        if batch is None:
            return
        values, error = [], None
        for k, fn in enumerate(functions):
            try:
                values.extend(call_checked(fn, batch))
            except RewardError as e:  # the in-process path calls no further function after a failure
                error = (k, e.bare, str(e)[len(e.bare) :])
                break
        conn.send((None, values, error))
