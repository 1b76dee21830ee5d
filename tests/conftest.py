"""Session-wide test settings: one cache for the built-in models per test run (never the user's home),
and a share of the cores' torch threads per pytest-xdist worker.

REMAX_TEST_CACHE, when set, is reused across runs (e.g. a developer's warm cache); otherwise the
built-in models are built once into a temporary directory of this run and every test, subprocess
and torchrun child inherits it through REMAX_CACHE. Under pytest-xdist (`-n 2`) the workers share
the directory their controller made (builtin/models.py builds under a file lock, so the first
worker that needs a model builds it and the other waits for it); the controller removes it.
"""

import os
import shutil
import tempfile

import torch

RUN_CACHE = "REMAX_TEST_RUN_CACHE"  # the controller's temporary cache, inherited by xdist workers

_OWN_CACHE = None
if os.environ.get("REMAX_TEST_CACHE"):
    os.environ["REMAX_CACHE"] = os.environ["REMAX_TEST_CACHE"]
elif os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(RUN_CACHE):
    os.environ["REMAX_CACHE"] = os.environ[RUN_CACHE]
else:
    _OWN_CACHE = tempfile.mkdtemp(prefix="remax-test-cache-")
    os.environ["REMAX_CACHE"] = os.environ[RUN_CACHE] = _OWN_CACHE

# Under pytest-xdist the workers share the cores: a worker's in-process torch ops get its share of
# the threads (two workers on two cores: one each; a second thread only stalls behind the other
# worker's processes). Subprocesses set their own OMP_NUM_THREADS.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
