"""Session-wide test settings: one cache for the built-in models per test run (never the user's home).

REMAX_TEST_CACHE, when set, is reused across runs (e.g. a developer's warm cache); otherwise the
built-in models are built once into a temporary directory of this run and every test, subprocess
and torchrun child inherits it through REMAX_CACHE. Under pytest-xdist (`-n 2`) the workers share
the directory their controller made (builtin/models.py builds under a file lock, so the first
worker that needs a model builds it and the other waits for it); the controller removes it.
"""

import os
import shutil
import tempfile

RUN_CACHE = "REMAX_TEST_RUN_CACHE"  # the controller's temporary cache, inherited by xdist workers

_OWN_CACHE = None
if os.environ.get("REMAX_TEST_CACHE"):
    os.environ["REMAX_CACHE"] = os.environ["REMAX_TEST_CACHE"]
elif os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(RUN_CACHE):
    os.environ["REMAX_CACHE"] = os.environ[RUN_CACHE]
else:
    _OWN_CACHE = tempfile.mkdtemp(prefix="remax-test-cache-")
    os.environ["REMAX_CACHE"] = os.environ[RUN_CACHE] = _OWN_CACHE


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
