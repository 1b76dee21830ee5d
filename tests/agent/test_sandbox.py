"""The sandbox for model-written code (agent/sandbox.py): each hostile snippet returns an error text within its
limits and leaves this process's files, environment and processes as they were; plain code returns its output
exactly; run_python never raises. Small limits: the file takes ~25 s on 2 shared cores."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import psutil
import pytest

from remax_megatron.agent import sandbox
from remax_megatron.agent.sandbox import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = {"wall_s": 3.0, "cpu_s": 2.0, "memory_mb": 256, "max_processes": 16, "output_bytes": 4096}
# A hang guard, not a timing claim (timings belong in tools/bench_*.py): a call that returns this long after
# wall_s did not enforce it. Measured here: every hostile snippet returned within wall_s + 0.5 s.
MARGIN_S = 15.0
SECRET = "remax-sandbox-secret-7f3a91"
ESCAPES = ["/tmp/remax_sandbox_escape", "/tmp/escape.txt", os.path.join(ROOT, "escape.txt")]
AS_ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


@pytest.fixture
def caller(tmp_path, monkeypatch):
    """This process's state a run must leave alone: a secret variable, a sentinel file, its temporary area (the
    sandbox's host directory goes there), the escape targets; checked again after the test."""
    monkeypatch.setenv("REMAX_TEST_API_TOKEN", SECRET)
    monkeypatch.setenv("MASTER_ADDR", SECRET)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("untouched")
    # what this pytest worker already runs (another test file's fork server, under xdist) and the repository's
    # entries (the other worker may add its own, e.g. outputs/): only what appears during the test counts
    children, listing = {p.pid for p in psutil.Process().children(recursive=True)}, set(os.listdir(ROOT))
    environ = _environ()
    assert not [p for p in ESCAPES if os.path.exists(p)], "a previous run left an escape file"
    yield {"sentinel": str(sentinel), "pid": os.getpid(), "pgid": os.getpgid(0)}
    found = [p for p in ESCAPES if os.path.exists(p)]
    for path in found:  # first: the next test must not find them
        os.remove(path)
    assert not found, f"the sandbox wrote {found}"
    assert sentinel.read_text() == "untouched"
    assert _environ() == environ
    assert not {n for n in set(os.listdir(ROOT)) - listing if "escape" in n or "sandbox" in n}
    assert os.listdir(temp) == [], "the sandbox's directory was not removed"
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in children] == []
    assert _left_behind() == []


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own, per phase


def _left_behind() -> list[int]:
    """Processes of a finished run of this process: a sandbox uid (as root: UID_BASE + its launcher's pid) whose
    launcher is gone. (Another pytest worker's running sandbox still has its launcher.)"""
    left = []
    for p in psutil.process_iter(["uids"]):
        uid = p.info["uids"].real if p.info["uids"] else -1
        if uid >= sandbox.UID_BASE and not psutil.pid_exists(uid - sandbox.UID_BASE):
            left.append(p.pid)
    return left


def _timed(code: str, **limits) -> tuple[str, float]:
    limits = {**LIMITS, **limits}
    start = time.monotonic()
    text = run_python(code, **limits)
    seconds = time.monotonic() - start
    assert seconds < limits["wall_s"] + MARGIN_S, (seconds, text[:500])
    return text, seconds


def _body(text: str) -> str:
    """The text without the "[sandbox: ...]" header a weaker isolation adds (none as root with namespaces)."""
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("[sandbox: "):
        lines.pop(0)
    return "".join(lines)


def test_plain_code_returns_its_output_exactly(caller):
    text, _ = _timed("print(2 + 3)")
    assert (text if AS_ROOT else _body(text)) == "5\n"
    text, _ = _timed("import sys\nprint('out')\nprint('err', file=sys.stderr)\nprint('out again')")
    assert _body(text) == "out\nerr\nout again\n"  # one stream, in the order written


def test_an_exception_returns_its_traceback(caller):
    text, _ = _timed("def f():\n    return 1 / 0\nprint('before')\nf()")
    body = _body(text)
    assert body.startswith("exited with code 1\nbefore\nTraceback (most recent call last):\n"), body
    assert "return 1 / 0" in body and body.endswith("ZeroDivisionError: division by zero\n")


@pytest.mark.parametrize(
    "code, status",
    [
        (None, "sandbox error: code must be a str, not NoneType"),
        ("x = '\0'", "exited with code 1"),  # SyntaxError: null bytes
        ("x = '\ud800'", "exited with code 1"),  # a lone surrogate
        ("import sys; sys.exit(3)", "exited with code 3"),
        ("import ctypes; ctypes.string_at(0)", "killed by signal SIGSEGV"),
        ("raise KeyboardInterrupt", "killed by signal SIGINT"),  # how Python exits on one
        ("# " + "x" * 2_000_000 + "\nprint('long')", None),
    ],
    ids=["not-str", "null-byte", "surrogate", "exit-3", "segfault", "keyboard-interrupt", "2mb-of-code"],
)
def test_run_python_never_raises(caller, code, status):
    text, _ = _timed(code)
    assert _body(text).startswith(status) if status else _body(text) == "long\n"


HOSTILE = {
    "fork-bomb": ("import os\nwhile True: os.fork()", ("exited", "timed out", "killed", "output truncated")),
    "quiet-fork-bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        ("timed out", "killed: CPU time limit"),
    ),
    "endless-loop": ("while True: pass", ("killed: CPU time limit 2 s", "timed out after 3 s")),  # a busy machine
    "sleeps": ("import time; time.sleep(600)", ("timed out after 3 s",)),
    "50gb": ("b = bytearray(50 * 2**30)", ("exited with code 1 (memory limit 256 MB)",)),
    # The kernel refuses 50 GB itself (overcommit heuristic); 1 GB only RLIMIT_AS refuses.
    "1gb": ("b = bytearray(2**30)\nprint('allocated')", ("exited with code 1 (memory limit 256 MB)",)),
    "gigabyte-print": ("for _ in range(1024): print('x' * 2**20)", ("output truncated at 4096 bytes",)),
    "100mb-file": ("open('big', 'wb').write(b'x' * 100 * 2**20)", ("exited with code 1",)),
    "escape-parent-dir": ("open('../escape.txt', 'w').write('x')", ("exited with code 1",)),
    "escape-tmp": ("open('/tmp/remax_sandbox_escape', 'w').write('x')", ("exited with code 1",)),
    "escape-by-umount": (  # as root in its mount namespace it could: the uid drop is what stops it
        "import ctypes\nctypes.CDLL(None).umount2(b'/tmp', 2)\nopen('/tmp/remax_sandbox_escape', 'w').write('x')",
        ("exited with code 1",),
    ),
    "escape-repo": (f"open({os.path.join(ROOT, 'escape.txt')!r}, 'w').write('x')", ("exited with code 1",)),
    "escape-home": (f"open({os.path.expanduser('~/remax_sandbox_escape')!r}, 'w')", ("exited with code 1",)),
    "sentinel": ("open(SENTINEL, 'w').write('overwritten')", ("exited with code 1",)),
    "grandchild-leaves": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n"
        "    os._exit(0)\ntime.sleep(600)",
        ("timed out after 3 s",),
    ),
    "orphan-outlives": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('parent exits')",
        ("parent exits",),
    ),
}


def test_endless_output_is_stopped_at_the_cap_not_at_the_wall_limit(caller):
    """The program is stopped once its output passes output_bytes: an endless print reports the cap, where a
    pool that only truncated what it read would let it run into wall_s ("timed out")."""
    text, _ = _timed("while True: print('x' * 2**16)", wall_s=30.0)
    assert _body(text).startswith("output truncated at 4096 bytes"), _body(text)[:200]


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_is_stopped_and_leaves_nothing(caller, name):
    code, statuses = HOSTILE[name]
    text, seconds = _timed(code.replace("SENTINEL", repr(caller["sentinel"])))
    body = _body(text)
    assert body.startswith(statuses), body[:600]
    print(f"{name}: {seconds:.2f} s: {body[:120]!r}")
    if name == "gigabyte-print":
        assert len(body) < 4096 + 100, len(body)
    if name in ("50gb", "quiet-fork-bomb", "endless-loop"):
        assert "Traceback" in body or len(body) < 300


def test_the_rlimits_are_set(caller):
    """Exactly (the behaviour is checked above, but a machine under load may reach wall_s first)."""
    code = (
        "import resource as r\n"
        "for n in 'CPU AS FSIZE NPROC CORE NOFILE'.split(): print(n, r.getrlimit(getattr(r, 'RLIMIT_' + n)))"
    )
    text, _ = _timed(code, cpu_s=1.5, memory_mb=200, max_processes=7)
    mb = 2**20
    assert _body(text).splitlines() == [
        "CPU (2, 3)",  # SIGXCPU at the soft limit (cpu_s rounded up), SIGKILL a second later
        f"AS ({200 * mb}, {200 * mb})",
        f"FSIZE ({sandbox.WORKSPACE_MB * mb}, {sandbox.WORKSPACE_MB * mb})",
        "NPROC (7, 7)" if AS_ROOT else _body(text).splitlines()[3],
        "CORE (0, 0)",
        f"NOFILE ({sandbox.OPEN_FILES}, {sandbox.OPEN_FILES})",
    ], text


def test_processes_are_limited_to_max_processes(caller):
    code = textwrap.dedent("""
        import os, time
        n = 1
        while n < 100:
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
            except OSError:
                break
            n += 1
        print(n)
    """)
    text, _ = _timed(code, max_processes=8)
    assert 1 < int(_body(text)) <= 8, text


def test_the_environment_is_not_the_callers(caller):
    code = f"import os\nprint(sorted(os.environ.items()))\nprint(open('/proc/{caller['pid']}/environ').read())"
    text, _ = _timed(code)
    assert SECRET not in text
    assert "'PATH', '/usr/bin:/bin'" in text and "REMAX_TEST_API_TOKEN" not in text and "MASTER_ADDR" not in text


def test_no_network(caller):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    with server:
        text, _ = _timed(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('reached')")
        with pytest.raises(socket.timeout):
            server.accept()
    assert "reached" not in text and _body(text).startswith("exited with code 1"), text
    text, _ = _timed("import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=2)\nprint('reached')")
    assert "reached" not in text and _body(text).startswith("exited with code 1"), text


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.kill(os.getppid(), 9)",
        "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
        "import os\nos.killpg(0, 9)",
        "import os\nos.kill(-1, 9)",
        "import os\nos.kill(PID, 9)",
        "import os\nos.killpg(PGID, 9)",
    ],
    ids=["ppid", "ppid-group", "own-group", "everyone", "caller-pid", "caller-group"],
)
def test_the_code_cannot_kill_the_caller(caller, code):
    code = code.replace("PGID", str(caller["pgid"])).replace("PID", str(caller["pid"]))
    _timed(code + "\nimport time\ntime.sleep(0.2)")
    assert psutil.Process(caller["pid"]).is_running()  # and this test is still running


def test_concurrent_runs_do_not_share_limits(caller):
    """Each run as root has a uid of its own: four runs at once each fork up to their own max_processes."""
    code = (
        "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        time.sleep(1)\n        os._exit(0)\n"
        "print('ok')"
    )
    texts = []
    threads = [threading.Thread(target=lambda: texts.append(_timed(code, max_processes=8)[0])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [_body(t) for t in texts] == ["ok\n"] * 4, texts


def test_the_sandbox_dies_with_its_caller(caller):
    """A caller killed mid-run (SIGKILL: no clean-up of its own) takes the whole sandbox with it."""
    script = (
        "from remax_megatron.agent.sandbox import run_python\n"
        "run_python('import os, time\\nos.fork()\\nprint(\"started\", flush=True)\\ntime.sleep(600)', wall_s=60)"
    )
    temp = os.path.join(tempfile.gettempdir(), "caller")  # the fixture's: checked empty after the test
    os.mkdir(temp)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, TMPDIR=temp))
    deadline = time.monotonic() + 10
    while len(sandboxed := psutil.Process(child.pid).children(recursive=True)) < 4:  # launcher, init, code, fork
        assert time.monotonic() < deadline, "the sandbox did not start"
        time.sleep(0.05)
    child.kill()
    child.wait()
    deadline = time.monotonic() + 5
    while alive := [p for p in sandboxed if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"still running: {alive}"
        time.sleep(0.05)
    # What a caller killed by SIGKILL leaves: its temporary directory, with the code in it (its finally never ran).
    (left,) = os.listdir(temp)
    assert os.listdir(os.path.join(temp, left)) == ["main.py"]
    shutil.rmtree(temp)


def _interpreter_open_to_all() -> str | None:
    """An interpreter every uid may run without a mount namespace (pyenv's under /root is not)."""
    for path in (os.path.realpath(sys.executable), os.path.realpath("/usr/bin/python3")):
        parents = [path] + [os.path.dirname(path)]
        while parents[-1] != "/":
            parents.append(os.path.dirname(parents[-1]))
        if os.path.exists(path) and all(os.stat(p).st_mode & 0o001 for p in parents):
            return path
    return None


@pytest.mark.skipif(not AS_ROOT, reason="the fallback's uid drop needs root")
def test_the_fallback_without_namespaces_says_so(caller, monkeypatch):
    monkeypatch.setattr(sandbox, "NAMESPACES", False)
    monkeypatch.setattr(sandbox, "PYTHON", "/root/.remax-closed/python3")
    text, _ = _timed("print(2 + 3)")
    assert "sandbox error: starting python: " in text and "set sandbox.PYTHON to an interpreter" in text, text
    python = _interpreter_open_to_all()
    if python is None:
        pytest.skip("no interpreter here that another uid may run")
    monkeypatch.setattr(sandbox, "PYTHON", python)
    open_temp = tempfile.mkdtemp(prefix="remax-sandbox-test-", dir="/tmp")  # the code's uid must reach its dir
    os.chmod(open_temp, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", open_temp)
    try:
        _fallback_holds(caller)
    finally:
        assert os.listdir(open_temp) == []
        os.rmdir(open_temp)


def _fallback_holds(caller):
    text, _ = _timed("print(2 + 3)")
    assert text.startswith("[sandbox: no namespaces (turned off): network reachable") and _body(text) == "5\n"
    text, _ = _timed(f"open({os.path.join(ROOT, 'escape.txt')!r}, 'w')")
    assert "Permission denied" in text, text  # the uid drop still holds
    _timed(f"import os\nos.kill({caller['pid']}, 9)")
    text, _ = _timed(HOSTILE["grandchild-leaves"][0])
    assert _body(text).startswith("timed out after 3 s"), text
