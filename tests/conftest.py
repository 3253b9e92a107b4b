"""How the test process ends.

The test process hosts what no server process does all at once: a Ray driver (tests/cluster, the
cluster model test), whose gRPC and Serve router threads outlive `ray.shutdown()`, tqdm monitor
threads from transformers, and two OpenMP runtimes (torch's and the native decode loop's). Once
every test has run and pytest has printed its report, CPython's finalization tears modules down
under those threads, and that occasionally crashed with SIGSEGV after "730 passed" (CI, session
10), failing `make test` with every test green. So once pytest is done the process exits with
pytest's own status, skipping finalization.

What this does not hide: a server process that does not exit cleanly. Those run as subprocesses
and their exit status after SIGTERM is asserted (tests/integration/conftest.py,
tests/unit/test_shutdown.py). A crash during the tests themselves still fails them (faulthandler
prints every thread's stack: `make test` runs python with -X faulthandler).
"""

from __future__ import annotations

import atexit
import os
import sys

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # atexit runs after pytest has returned (report printed, capture undone, temporary folders
    # handled) and before finalization; handlers run last-registered first, so this one comes
    # before those of the libraries imported earlier (Ray's own shutdown among them).
    atexit.register(_exit_now, int(exitstatus))


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
