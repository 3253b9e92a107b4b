"""How the test process ends, and what its report ends with.

The report's last section names the CPU (its kind, as the server logs it, and its model): several
tests run the embedded model, whose greedy replies follow the CPU's kernels, so a failure in CI
on another machine needs it to be read.

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
from pathlib import Path

import pytest


def pytest_terminal_summary(terminalreporter) -> None:
    from dflash.engine.cpu import cpu_kind

    terminalreporter.write_sep("-", f"cpu {cpu_kind()}: {_cpu_model()}")


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "model unknown (no /proc/cpuinfo)"
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return f"{fields.get('model name', '?')}, family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # atexit runs after pytest has returned (report printed, capture undone, temporary folders
    # handled) and before finalization; handlers run last-registered first, so this one comes
    # before those of the libraries imported earlier (Ray's own shutdown among them).
    atexit.register(_exit_now, int(exitstatus))


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
