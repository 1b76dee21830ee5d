"""A run owns its output and checkpoint directories for its lifetime.

    lock = RunLock.acquire({"trainer.output_dir": out, "checkpoint.dir": ckpt})  # DirectoryInUse: one line
    ...                                                                           # the run
    lock.release()                                                                # or the process exits

Each directory gets `.remax-run.lock`, held with an exclusive `fcntl.flock` and naming its holder
(host, pid, start time). The kernel drops an flock with the last descriptor of its file, so a run
that crashed or was SIGKILLed leaves nothing that blocks the next one: a leftover lock file that
no process holds is simply taken over.

Who takes it: global rank 0 only (startup.claim_run), and it tells the other ranks the verdict.
Rank 0 is the process that writes metrics.jsonl, config.yaml, the checkpoint manifests and
`latest`, and it creates every checkpoint's temporary directory, which all ranks then write into:
in a multi-node job the checkpoint directory is on a filesystem every node sees, so one lock
there serves the whole job, while a lock per node would refuse the job's own other nodes. flock on
NFS (v4, or v3 with a lock manager) and Lustre (mounted with `flock`) is seen by every client; a
filesystem without cluster-wide flock only keeps out runs on rank 0's node.

Forked children (megatron's checkpoint writers) inherit the descriptor and would keep the lock
alive after the run died: they close it (processes.py closes every descriptor registered here).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket

LOCK_NAME = ".remax-run.lock"

# Descriptors of the locks this process holds: a forked child closes them (remax_megatron.processes).
HELD_FDS: set[int] = set()
_LIVE: list[RunLock] = []  # for release_all


class DirectoryInUse(ValueError):
    """Another live run holds the lock of a directory this run needs (one line, naming it)."""


class RunLock:
    def __init__(self):
        self._held: list[tuple[str, int]] = []  # (lock file, descriptor)
        self._created: list[str] = []  # directories this run created, deepest last

    @classmethod
    def acquire(cls, directories: dict[str, str]) -> RunLock:
        """Lock every directory of {config key: path} (one lock for paths that are the same directory),
        creating missing ones. DirectoryInUse names the key, the path and the holder; nothing this
        call created stays behind then."""
        lock = cls()
        seen = set()
        try:
            for key, path in directories.items():
                real = os.path.realpath(path)
                if real in seen:
                    continue
                seen.add(real)
                lock._created += _makedirs(path)
                lock._take(key, path)
        except BaseException:
            lock.release()
            raise
        return lock

    def _take(self, key: str, path: str) -> None:
        lock_file = os.path.join(path, LOCK_NAME)
        while True:
            # O_CREAT without O_TRUNC: a refused run does not touch the holder's file.
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DirectoryInUse(
                        f"{key}={path}: cannot lock {lock_file} ({e.strerror}): point it at a "
                        "directory on a filesystem with working file locks"
                    ) from None
                raise DirectoryInUse(
                    f"{key}={path} is in use by another run ({holder}): wait for it to end or "
                    f"stop it, or give this run another {key}"
                ) from None
            # The file may have been released and removed between our open and our flock (release()
            # unlinks it): then we hold a lock on a file nobody else will open. Start over.
            try:
                same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "since": datetime.datetime.now().isoformat(timespec="seconds"),
                }
            ).encode(),
        )
        self._held.append((lock_file, fd))
        HELD_FDS.add(fd)
        if self not in _LIVE:
            _LIVE.append(self)

    def release(self) -> None:
        """Remove the lock files (while still holding them) and the directories this run created that
        are still empty, then drop the locks. Idempotent."""
        for lock_file, fd in reversed(self._held):
            try:
                os.unlink(lock_file)
            except OSError:
                pass
            HELD_FDS.discard(fd)
            os.close(fd)
        self._held = []
        for path in reversed(self._created):
            try:
                os.rmdir(path)
            except OSError:  # not empty: the run wrote into it
                pass
        self._created = []
        if self in _LIVE:
            _LIVE.remove(self)


def release_all() -> None:
    """Release every lock this process holds (a process about to os._exit)."""
    for lock in list(_LIVE):
        lock.release()


def _read_holder(fd: int) -> str:
    """'host H, pid P, since T' from a held lock file (its holder may still be writing it)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "starting up"


def _makedirs(path: str) -> list[str]:
    """os.makedirs(path); returns the directories it created, outermost first."""
    missing = []
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(path, exist_ok=True)
    return list(reversed(missing))
