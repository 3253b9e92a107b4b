"""One real server (`python -m dflash.cli run`) on the embedded model for the whole integration
suite: loading the model once keeps the suite within minutes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.clis import CLAUDE_CODE, CODEX, installed

ROOT = Path(__file__).parents[2]
START_TIMEOUT_S = 300
MAX_CTX = 2048


@contextlib.contextmanager
def running_server(folder: Path, config_text: str):
    """A `dflash run` process on a free loopback port; yields its start-up log line."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "server.toml"
    config.write_text(config_text)
    log_path = folder / "server.log"
    with open(log_path, "w") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "dflash.cli", "run", str(config)], cwd=ROOT,
                                   stdout=log_file, stderr=log_file,
                                   env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        yield _wait_for_start(process, log_path)
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=30)
        assert exit_code == 0, f"exit code {exit_code} after SIGTERM:\n{log_path.read_text()[-3000:]}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def server_config(speculative: dict | None = None, **cache: object) -> str:
    def lines(keys: dict) -> str:
        return "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())

    return (f'[server]\nport = 0\nshutdown_grace_s = 5\n[model]\nmax_ctx = {MAX_CTX}\n'
            f'[speculative]\n{lines(speculative or {})}[cache]\n{lines(cache)}[logging]\nformat = "json"\n')


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """(base URL, model id) of the running server."""
    with running_server(tmp_path_factory.mktemp("server"), server_config(agent_turn_cache=True)) as started:
        yield started["listening"], started["model"]


@pytest.fixture(scope="session")
def codex() -> Path:
    """The pinned Codex CLI's executable (installed from npm on first use)."""
    return installed(CODEX)


@pytest.fixture(scope="session")
def claude_code() -> Path:
    """The pinned Claude Code CLI's executable (installed from npm on first use)."""
    return installed(CLAUDE_CODE)


def _wait_for_start(process: subprocess.Popen, log_path: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "started":
                return json.loads(line)
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"the server did not start within {START_TIMEOUT_S}s")
