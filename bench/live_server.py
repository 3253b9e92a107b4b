"""A dflash server in a subprocess on 127.0.0.1, for the stress scripts in bench/.

The real model (`python -m dflash.cli run`) or, with `fake=True`, the fake engine of the unit
tests (`python -m tests.unit.fakes`). Its JSON log goes to a file the scripts read back: the
server's own numbers (job_cancelled stop times, request lines) are part of what they report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300


def to_toml(sections: dict[str, dict]) -> str:
    def value(item) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, dict):  # an inline table
            return "{" + ", ".join(f"{key} = {value(element)}" for key, element in item.items()) + "}"
        if isinstance(item, (list, tuple)):
            return "[" + ", ".join(value(element) for element in item) + "]"
        return json.dumps(item)

    return "".join(f"[{name}]\n" + "".join(f"{key} = {value(item)}\n" for key, item in settings.items())
                   for name, settings in sections.items())


class LiveServer:
    def __init__(self, *, fake: bool, server: dict | None = None, model: dict | None = None,
                 fake_args: tuple[str, ...] = (), cache: dict | None = None, cluster: dict | None = None):
        """`cluster`: run `dflash cluster` with this [cluster] table (stop it with `stop`, which
        lets it shut its Ray down; a kill would leave Ray's processes behind)."""
        self._folder = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
        self.config_path = self._folder / "server.toml"
        self.log_path = self._folder / "server.log"
        self.config_path.write_text(to_toml({
            "server": {"host": "127.0.0.1", "port": 0, **(server or {})},
            "model": model or {},
            "cache": cache or {},
            "logging": {"format": "json"},
            **({"cluster": cluster} if cluster else {}),
        }))
        entry = ["-m", "tests.unit.fakes", str(self.config_path), *fake_args] if fake else \
            ["-m", "dflash.cli", "cluster" if cluster else "run", str(self.config_path)]
        self._command = [sys.executable, *entry]
        self.process: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> LiveServer:
        with open(self.log_path, "w") as log_file:
            self.process = subprocess.Popen(self._command, cwd=ROOT, stdout=log_file, stderr=log_file,
                                            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        started = self._wait_for("started", START_TIMEOUT_S)
        self.port = int(started["listening"].rsplit(":", 1)[1])
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    @property
    def pid(self) -> int:
        return self.process.pid

    def events(self, name: str | None = None) -> list[dict]:
        events = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if name is None or event.get("event") == name:
                    events.append(event)
        return events

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def remove_files(self) -> None:
        """Delete the config and log (kept until then so a failed run can point at them)."""
        shutil.rmtree(self._folder, ignore_errors=True)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait: the exit code of a graceful shutdown (0 expected)."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def _wait_for(self, event_name: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(event_name)
            if found:
                return found[0]
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"server did not log {event_name!r} within {timeout}s; log: {self.log_path}")


def report_verdict(server: LiveServer, failures: list[str]) -> int:
    """Print the failures (or PASS); the exit code: 0 with the server's files removed, or 1 with
    its log kept for a look."""
    for failure in failures:
        print(f"FAIL: {failure}")
    print("PASS" if not failures else f"{len(failures)} failure(s); server log: {server.log_path}")
    if failures:
        return 1
    server.remove_files()
    return 0


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [headers, *[[_cell(item) for item in row] for row in rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(text.ljust(width) for text, width in zip(row, widths)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def _cell(item) -> str:
    if isinstance(item, float):
        return f"{item:.3f}"
    return str(item)
