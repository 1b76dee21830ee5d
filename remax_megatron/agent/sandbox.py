"""Run model-written Python as hostile input: `run_python(code)` returns what it printed, or an error text.

    from remax_megatron.agent.sandbox import run_python
    run_python("print(2 + 3)")                  # "5\\n"
    run_python("while True: pass", wall_s=3)    # "timed out after 3 s\\n"

Each call starts a fresh `python -I -S -u main.py` (isolated mode: no PYTHON* variables, no site, no user site,
no script directory on sys.path) in a directory of its own, with a clean environment (PATH, HOME and TMPDIR = that
directory, LANG; nothing of this process's: no tokens, keys or MASTER_ADDR), stdin /dev/null, stdout and stderr
merged in one pipe (in the order written), and returns that output (at most `output_bytes`: a program that writes
more is stopped and its output truncated, saying so). It never raises for anything the code does (a failure of
this machine is a "sandbox error: ..." text too) and returns within wall_s plus about a second.

How, on Linux (stdlib only; no preexec_fn: the caller may run threads). Three processes: a launcher
(`python -I -S sandbox.py`, started in a new session) enters new namespaces and prepares the mounts; its child is
the init of the new PID namespace; the init's child drops its privileges, sets its rlimits and execs the code.

- As root (checked here): new mount, network, PID, IPC and UTS namespaces (unshare(2) through ctypes). Mounts are
  made private (nothing propagates to the host), every mount is bind-remounted read-only, /tmp and /var/tmp become
  empty read-only tmpfs, the code's directory a tmpfs of WORKSPACE_MB (/tmp/remax-sandbox-*; the host directory of
  that name stays empty), /dev holds null, zero, full, random and urandom only (no GPU: its 0666 nodes would let
  the code take GPU memory) and a private SHM_MB /dev/shm, /proc shows the namespace's processes only, and a
  directory closed to others above the interpreter (/root for pyenv's) becomes an empty read-only tmpfs with the
  interpreter's installation bound back in at its own path (its libpython is found by that path). The code
  runs as a uid of its own, UID_BASE + the launcher's pid (unique among live processes; 65534 nobody/nogroup where
  that uid does not exist, e.g. in a container's user namespace), no supplementary groups, no_new_privs: it cannot
  signal this process (other uid, and not in its PID namespace), RLIMIT_NPROC counts its processes only (threads
  included), it writes nowhere but its directory and /dev/shm (both gone when it ends), and it gets a new session
  keyring (not the caller's keys; best effort: keyctl may be blocked by seccomp). The network namespace
  has only a loopback that is down: no connection to this machine (127.0.0.1, abstract sockets) or any other.
- Not root, where user namespaces are allowed (checked here as nobody): the same namespaces inside a new user
  namespace that maps only the caller's uid, so the code runs as the CALLER'S uid, without capabilities (dropped
  at exec). It still sees every file read-only and cannot reach this process (PID namespace), but it can READ
  whatever the caller can read (its home, its keys): the returned text says so in a "[sandbox: ...]" header.
- Neither (a container without CAP_SYS_ADMIN, user namespaces off): no namespaces, and the header says what is
  missing. As root the uid drop still applies (the world-writable /tmp, /var/tmp and /dev/shm are then writable,
  the network is open); not as root, the code runs as the caller: it can read and write the caller's files,
  signal its processes (kill this one) and use the network; RLIMIT_NPROC is then the caller's current count plus
  max_processes. Tests set NAMESPACES = False to check that header.

Limits, in every mode: wall time (the launcher is a child subreaper, so a grandchild that leaves the session or
whose parent died is still its descendant; at the deadline every descendant is SIGKILLed, found by scanning /proc,
until none is left; in a PID namespace killing its init kills them all), RLIMIT_CPU (SIGXCPU, then SIGKILL a
second later), RLIMIT_AS (memory_mb: allocations past it raise MemoryError), RLIMIT_FSIZE (WORKSPACE_MB),
RLIMIT_NPROC, RLIMIT_NOFILE, no core dumps. Every process dies with this one (PR_SET_PDEATHSIG at each level,
set after the uid change, which clears it) and the temporary directory is removed (unless this process is
SIGKILLed: its clean-up never runs, so the directory with main.py in it stays; no process does).

NOT protected: kernel exploits and anything seccomp would block (every system call is allowed); reading
world-readable files (/etc, the project's source, models and data on shared disks unless their permissions say
otherwise); CPU and memory-bandwidth contention with the trainer (no cgroup: the code may take a core for wall_s;
RLIMIT_AS bounds one process's address space, not max_processes x memory_mb, and tmpfs pages up to WORKSPACE_MB +
SHM_MB count against the machine's memory, not the code's); without namespaces, /dev as it is (GPUs included);
timing and side channels. A filesystem Unix socket the uid may open (a root-only docker.sock is not)
is reachable: network namespaces do not cover them.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

WORKSPACE_MB = 64  # the code's directory (a tmpfs under namespaces) and the largest file it may write
SHM_MB = 16  # /dev/shm under namespaces (multiprocessing's semaphores live there)
OPEN_FILES = 256
UID_BASE = 2_000_000_000  # as root the code runs as UID_BASE + its launcher's pid: one uid per live run
FALLBACK_ID = 65534  # nobody/nogroup, where that uid does not exist (a container's user namespace)
KILL_S = 2.0  # after the deadline: killing every process of the run, then the launcher's exit
PYTHON: str | None = None  # the interpreter the code runs in (None: this one, sys.executable with links resolved)
NAMESPACES = True  # False: the no-namespace fallback (tests check that its weakness is reported)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 0x400, 0x800, 0x1000, 0x4000, 0x40000, 0x200000
# Per-mount options a read-only bind remount must keep (in a user namespace they are locked: dropping one fails).
MOUNT_OPTIONS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
DEVICES = ("null", "zero", "full", "random", "urandom")  # all of /dev the code sees under namespaces
KEYCTL_JOIN_SESSION_KEYRING, SYS_KEYCTL = 1, {"x86_64": 250, "aarch64": 219}  # keyctl(2) has no glibc wrapper

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def run_python(
    code: str,
    *,
    wall_s: float = 10.0,
    cpu_s: float = 5.0,
    memory_mb: int = 512,
    max_processes: int = 16,
    output_bytes: int = 8192,
) -> str:
    """Run `code` in the sandbox (see the module docstring); its output, or an error text naming the limit or
    exit code first ("timed out after 10 s", "exited with code 1", ...) and then the output. Never raises for
    anything the code does."""
    if not isinstance(code, str):
        return f"sandbox error: code must be a str, not {type(code).__name__}"
    limits = {"cpu_s": cpu_s, "memory_mb": memory_mb, "max_processes": max_processes}
    try:
        workdir = tempfile.mkdtemp(prefix="remax-sandbox-")
    except OSError as e:
        return f"sandbox error: no temporary directory ({e})"
    try:
        return _run(code, workdir, wall_s, limits, output_bytes)
    except Exception as e:  # noqa: BLE001 - a failure of this machine (no fds, no memory), never the code's
        return f"sandbox error: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(code: str, workdir: str, wall_s: float, limits: dict, output_bytes: int) -> str:
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    report_r, report_w = os.pipe()  # the launcher's side channel: mode notes, the code's exit status, errors
    try:
        spec = dict(limits, parent=os.getpid(), workdir=workdir, report=report_w, namespaces=NAMESPACES)
        spec["executable"] = os.path.realpath(PYTHON or sys.executable)  # a venv's bin/ may be closed to the code
        spec["prefix"] = _install_prefix(spec["executable"])
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=_environment("/"),
                cwd="/",
                start_new_session=True,
                pass_fds=(report_w,),
            )
        finally:
            os.close(report_w)
        try:
            output, ending = _collect(process, time.monotonic() + wall_s, output_bytes)
        finally:
            _stop(process)
        report = _read_report(report_r)
    finally:
        os.close(report_r)
    return _describe(output[:output_bytes].decode("utf-8", "replace"), ending, report, wall_s, limits, output_bytes)


def _install_prefix(executable: str) -> str:
    """The directory holding the interpreter's whole installation (bin/, lib/): sys.base_prefix when it runs."""
    base = os.path.realpath(sys.base_prefix)
    if PYTHON is None and executable.startswith(base + os.sep):
        return base
    return os.path.dirname(os.path.dirname(executable))


def _environment(home: str) -> dict[str, str]:
    """All the environment the sandbox gets: none of this process's variables."""
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def _collect(process: subprocess.Popen, deadline: float, output_bytes: int) -> tuple[bytes, str]:
    """Its output until it ends ("exited"), writes more than output_bytes ("overflow") or the deadline ("timeout")."""
    chunks, size, fd = [], 0, process.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), "timeout"
            if not selector.select(left):
                continue
            data = os.read(fd, 1 << 16)
            if not data:  # every process of the run has closed it: the launcher is about to exit
                break
            chunks.append(data)
            size += len(data)
            if size > output_bytes:
                return b"".join(chunks), "overflow"
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"".join(chunks), "timeout"
    return b"".join(chunks), "exited"


def _stop(process: subprocess.Popen) -> None:
    """Kill every process of the run, then reap the launcher: nothing is left running."""
    if process.poll() is None:  # not reaped, so its pid is still its own (after a wait it could be reused)
        _kill_descendants(process.pid, KILL_S)
        try:
            process.wait(KILL_S)  # it reaps what was killed, then exits
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    process.stdout.close()


def _read_report(fd: int) -> dict:
    """The launcher's side channel, read once every writer is gone: {"note": [...], "status": int, "error": str}."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except BlockingIOError:  # a writer still open: only if the run could not be killed
        pass
    report: dict = {"note": []}
    for line in data.decode("utf-8", "replace").splitlines():
        key, value = json.loads(line)
        if key == "note":
            report["note"].append(value)
        else:
            report[key] = value
    return report


def _describe(text: str, ending: str, report: dict, wall_s: float, limits: dict, output_bytes: int) -> str:
    header = "".join(f"[sandbox: {note}]\n" for note in report["note"])
    if ending == "timeout":
        status = f"timed out after {wall_s:g} s"
    elif ending == "overflow":
        status = f"output truncated at {output_bytes} bytes (the program was stopped)"
    elif "error" in report:
        status = f"sandbox error: {report['error']}"
    elif "status" not in report:
        status = "sandbox error: the sandbox ended without the program's exit status"
    else:
        status = _exit_text(report["status"], text, limits)
    return header + (text if status is None else f"{status}\n{text}")


def _exit_text(status: int, text: str, limits: dict) -> str | None:
    """None for exit code 0; else what ended it."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return f"killed: CPU time limit {limits['cpu_s']:g} s"
        try:
            return f"killed by signal {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return None
    if "MemoryError" in text:
        return f"exited with code {code} (memory limit {limits['memory_mb']} MB)"
    return f"exited with code {code}"


def _descendants(pid: int) -> list[int]:
    """Every live (not zombie) descendant of pid, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat[stat.rindex(b")") + 2 :].split()[:2]  # the name in () may hold spaces and parens
        if state != b"Z":
            children.setdefault(int(ppid), []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill_descendants(pid: int, give_up_s: float) -> None:
    """SIGKILL pid's descendants until none is left (a fork between the scan and the kill is caught by the next
    round: the orphan goes to the subreaper launcher)."""
    end = time.monotonic() + give_up_s
    while (found := _descendants(pid)) and time.monotonic() < end:
        for child in found:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)


# ---- the sandbox side: the launcher, the namespace's init and the code's process ----


def _launch(spec: dict) -> None:
    """The launcher: namespaces and mounts, then the init; reaps until every process of the run is gone."""
    report = spec["report"]
    os.set_inheritable(report, False)  # the code's exec closes it
    _die_with(spec["parent"])
    try:
        with open(os.path.join(spec["workdir"], "main.py"), "rb") as f:
            code = f.read()
        ids, workspace, namespaces, notes = _isolate(spec, code)
    except Exception as e:  # noqa: BLE001 - reported as a sandbox error, never as the code's output
        _tell(report, "error", f"setting up: {type(e).__name__}: {e}")
        os._exit(1)
    for note in notes:
        _tell(report, "note", note)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the run become ours (without a PID namespace: see _reap)
    init = os.fork()
    if init == 0:
        _init(spec, ids, workspace, namespaces, os.getppid())
    os.close(report)
    _reap(init)
    os._exit(0)


def _reap(init: int) -> None:
    """Wait for the init; then kill what is left (only without a PID namespace) and reap it all."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        if pid == init:
            _kill_descendants(os.getpid(), KILL_S)


def _isolate(spec: dict, code: bytes) -> tuple[tuple[int, int] | None, str, bool, list[str]]:
    """Enter the namespaces and mount the workspace; the ids to run the code as (None: stay), the workspace,
    whether namespaces are on, and what the caller must be told about weaker isolation."""
    root, notes = os.geteuid() == 0, []
    try:
        if not spec["namespaces"]:
            raise OSError("turned off")
        _enter_namespaces(root)
        namespaces = True
    except OSError as e:
        namespaces, reason = False, e.strerror or str(e)
    if namespaces:
        workspace, writable = _private_mounts(spec["workdir"], spec["prefix"] if root else None)
        with open(os.path.join(workspace, "main.py"), "wb") as f:
            f.write(code)
        os.chmod(os.path.join(workspace, "main.py"), 0o444)
        if writable:
            notes.append("these mounts stayed writable: " + ", ".join(writable))
        if not root:
            notes.append("not root: runs as your own uid in user namespaces: it can read every file you can")
    else:
        workspace = spec["workdir"]
        if root:
            notes.append(f"no namespaces ({reason}): network reachable, /tmp, /var/tmp and /dev/shm writable")
        else:
            notes.append(
                f"no namespaces ({reason}), not root: runs as your own uid: network reachable, "
                "it can read and write your files and signal your processes"
            )
    ids = _unprivileged_ids(workspace) if root else None
    return ids, workspace, namespaces, notes


def _enter_namespaces(root: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if root:
        _check(_libc.unshare(flags), "unshare")
        return
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | flags), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _private_mounts(workdir: str, prefix: str | None) -> tuple[str, list[str]]:
    """In the new mount namespace: everything read-only, the workspace a fresh tmpfs; (its path, the mount points
    that could not be made read-only). prefix: the interpreter's installation, to open to the code's uid."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # first: nothing below may propagate to the host
    writable = _read_only_everything()
    if prefix is not None:
        _open_to_others(prefix)
    workspace = os.path.join("/tmp", os.path.basename(workdir))
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.mkdir(workspace, 0o700)
    _mount(None, "/tmp", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount("tmpfs", workspace, "tmpfs", MS_NOSUID | MS_NODEV, f"size={WORKSPACE_MB}m,mode=0700")
    if os.path.isdir("/var/tmp"):
        _mount("tmpfs", "/var/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=1m,mode=0755")
    _minimal_dev()
    return workspace, writable


def _minimal_dev() -> None:
    """/dev with the harmless devices only (no GPU, disk or terminal: a GPU's 0666 node would let the code take its
    memory) and a private /dev/shm; read-only."""
    keep = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEVICES if os.path.exists(f"/dev/{name}")}
    try:
        _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=0755")
        for name, fd in keep.items():
            open(f"/dev/{name}", "w").close()  # a file to bind the device node onto
            _mount(f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
    finally:
        for fd in keep.values():
            os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "0"), ("stdout", "1"), ("stderr", "2")):
        os.symlink(target if name == "fd" else f"/proc/self/fd/{target}", f"/dev/{name}")
    os.mkdir("/dev/shm")
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={SHM_MB}m,mode=1777")
    _mount(None, "/dev", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _read_only_everything() -> list[str]:
    """Bind-remount every mount read-only (MS_BIND: the mount only, never its filesystem, which the host shares);
    the writable mount points that refused."""
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    refused = []
    for line in lines:
        fields = line.split()
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        options = fields[5].split(",")
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for name in options:
            flags |= MOUNT_OPTIONS.get(name, 0)
        try:
            _mount(None, point, None, flags)
        except OSError:
            if "ro" not in options:
                refused.append(point)
    return refused


def _open_to_others(prefix: str) -> None:
    """Let another uid run the interpreter at its own path (its libpython is found by that path): the topmost
    closed directory above it (/root for pyenv's) becomes an empty read-only tmpfs (hiding the rest of it) with
    the installation bound back in, read-only."""
    parts = prefix.strip("/").split("/")
    closed = next(
        (
            "/" + "/".join(parts[:i])
            for i in range(1, len(parts) + 1)
            if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001
        ),
        None,
    )
    if closed is None:
        return
    keep = os.open(prefix, os.O_PATH)
    try:
        _mount("tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        os.makedirs(prefix, 0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{keep}", prefix, None, MS_BIND | MS_REC)
    finally:
        os.close(keep)
    _mount(None, prefix, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    _mount(None, closed, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _unprivileged_ids(workspace: str) -> tuple[int, int]:
    """As root: the uid (= gid) the code runs as, owner of its workspace."""
    for uid in (UID_BASE + os.getpid(), FALLBACK_ID):
        try:
            os.chown(workspace, uid, uid)
            return uid, uid
        except OSError:  # EINVAL: not mapped in this (container's) user namespace
            continue
    raise OSError(f"no unprivileged uid to run as ({UID_BASE + os.getpid()} and {FALLBACK_ID} refused)")


def _init(spec: dict, ids: tuple[int, int] | None, workspace: str, namespaces: bool, launcher: int) -> None:
    """The init of the PID namespace (or the launcher's child without one): start the code, reap, report its
    status and exit (which, as the namespace's init, kills all the processes left in it)."""
    report = spec["report"]
    _die_with(0 if namespaces else launcher)  # the launcher is outside the namespace: seen as pid 0
    if namespaces:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as e:
            _tell(report, "note", f"/proc shows the host's processes ({e.strerror})")
    # A session of its own: killpg(0) from the code reaches the launcher's group across the PID namespace (the
    # group is the launcher's); as the same uid (user namespaces) it would kill the launcher.
    os.setsid()
    code = os.fork()
    if code == 0:
        _exec_code(spec, ids, workspace, namespaces)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)
        if pid == code:
            _tell(report, "status", status)
            os._exit(0)


def _exec_code(spec: dict, ids: tuple[int, int] | None, workspace: str, namespaces: bool) -> None:
    """The code's process: limits, the unprivileged ids, then exec the interpreter on main.py."""
    try:
        parent = os.getppid()
        os.chdir(workspace)
        _set_limits(spec, ids is None and not namespaces)
        if ids is not None:
            os.setgroups([])
            os.setresgid(ids[1], ids[1], ids[1])
            os.setresuid(ids[0], ids[0], ids[0])
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary gives it back
        if os.uname().machine in SYS_KEYCTL:  # a new, empty session keyring: not the caller's keys
            _libc.syscall(SYS_KEYCTL[os.uname().machine], KEYCTL_JOIN_SESSION_KEYRING, None)
        _die_with(parent)  # after the uid change, which clears it
        exe = spec["executable"]
        os.execve(exe, [exe, "-I", "-S", "-u", "main.py"], _environment(workspace))
    except BaseException as e:  # noqa: BLE001 - anything before the exec is the sandbox's failure
        hint = " (set sandbox.PYTHON to an interpreter this uid may run)" if isinstance(e, PermissionError) else ""
        _tell(spec["report"], "error", f"starting python: {type(e).__name__}: {e}{hint}")
    os._exit(127)


def _set_limits(spec: dict, shares_uid: bool) -> None:
    """The rlimits (never above a hard limit already set). shares_uid: the code runs as the caller with no user
    namespace of its own, so RLIMIT_NPROC counts the caller's tasks too."""
    processes = spec["max_processes"] + (_tasks_of(os.getuid()) if shares_uid else 0)
    for which, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, max(1, math.ceil(spec["cpu_s"]))),
        (resource.RLIMIT_AS, spec["memory_mb"] << 20),
        (resource.RLIMIT_FSIZE, WORKSPACE_MB << 20),
        (resource.RLIMIT_NPROC, processes),
        (resource.RLIMIT_NOFILE, OPEN_FILES),
    ):
        hard = resource.getrlimit(which)[1]
        extra = 1 if which == resource.RLIMIT_CPU else 0  # SIGXCPU at the soft limit, SIGKILL a second later
        if hard != resource.RLIM_INFINITY:
            value, extra = min(value, hard), min(extra, max(0, hard - value))
        resource.setrlimit(which, (value, value + extra))


def _tasks_of(uid: int) -> int:
    """How many tasks (threads) of real uid run now: what RLIMIT_NPROC counts."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if int(status.get("Uid", "-1 ").split()[0]) == uid:
            count += int(status.get("Threads", "1"))
    return count


def _die_with(parent: int) -> None:
    """SIGKILL when the parent dies (Linux: when the thread that started us exits); exit if it already has."""
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), "prctl")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    _check(_libc.mount(*args, flags, None if data is None else data.encode()), f"mount {target}")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _tell(fd: int, key: str, value) -> None:
    os.write(fd, (json.dumps([key, value]) + "\n").encode())


if __name__ == "__main__":  # the launcher: `python -I -S sandbox.py SPEC` (see run_python)
    _launch(json.loads(sys.argv[1]))
