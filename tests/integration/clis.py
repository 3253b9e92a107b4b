"""The real coding-agent CLIs, pinned to the versions the fixtures were captured from.

Each is installed from npm into a cache folder on first use (about 10 s and 650 MB for both) and
reused after; a file lock keeps parallel test runs from installing into the same folder at once.
Without npm or its registry the tests that need a CLI are skipped on a developer's machine, and
fail in CI (`CI` set), where a silent skip would hide that nothing was tested.

Both run non-interactively with a temporary HOME, so neither reads or writes the user's own
settings, and with only the environment named here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

CLI_CACHE = Path(os.environ.get("DFLASH_TEST_CLI_CACHE", "~/.cache/dflash-test-clis")).expanduser()
INSTALL_TIMEOUT_S = 900
VERSION_TIMEOUT_S = 60
API_KEY = "dflash-test-key"  # the server has no keys configured; the CLIs insist on sending one


@attrs.frozen
class NpmCli:
    package: str
    version: str
    command: str  # the executable the package installs

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"

    @property
    def folder(self) -> Path:
        return CLI_CACHE / self.spec.replace("/", "+")

    @property
    def executable(self) -> Path:
        # npm's launcher: it starts the native binary that the platform package (an optional
        # dependency, e.g. @openai/codex-linux-x64) brought along.
        return self.folder / "node_modules" / ".bin" / self.command


CODEX = NpmCli("@openai/codex", "0.171.0", "codex")
CLAUDE_CODE = NpmCli("@anthropic-ai/claude-code", "2.1.197", "claude")


def installed(cli: NpmCli) -> Path:
    """The CLI's executable, installed into the cache on first use."""
    CLI_CACHE.mkdir(parents=True, exist_ok=True)
    with locked(CLI_CACHE / f"{cli.folder.name}.lock"):
        if not _runs(cli):
            _npm_install(cli)
            if not _runs(cli):
                pytest.fail(f"{cli.spec} installed into {cli.folder}, but `{cli.command} --version` does not "
                            f"report {cli.version}: is the native binary of its platform package missing?")
    return cli.executable


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the real-client tests must run here)")
    pytest.skip(reason)


def _npm_install(cli: NpmCli) -> None:
    npm = shutil.which("npm")
    if npm is None:
        unavailable(f"npm is not on PATH: cannot install {cli.spec}")
    try:
        done = subprocess.run([npm, "install", "--prefix", str(cli.folder), "--no-audit", "--no-fund", cli.spec],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        unavailable(f"npm install {cli.spec} took over {INSTALL_TIMEOUT_S}s")
    if done.returncode != 0:
        unavailable(f"npm install {cli.spec} failed ({done.returncode}): {done.stderr[-1500:]}")


def _runs(cli: NpmCli) -> bool:
    if not cli.executable.exists():
        return False
    done = subprocess.run([str(cli.executable), "--version"], capture_output=True, text=True,
                          timeout=VERSION_TIMEOUT_S, env=clean_env(cli.folder))
    return done.returncode == 0 and cli.version in done.stdout


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def clean_env(home: Path, **settings: str) -> dict[str, str]:
    """PATH (node for the launchers, a shell for the tools), a throw-away HOME, and `settings`:
    nothing else of the caller's environment (API keys, proxies, CLI settings) leaks in."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb", **settings}


# ---- Claude Code ------------------------------------------------------------------------------

def claude_code_env(home: Path, base_url: str) -> dict[str, str]:
    # No retries and no non-streaming second try: a failure is the test's answer, and each try of a
    # long prompt on the CPU costs minutes.
    return clean_env(home, ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY=API_KEY,
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1",
                     DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_MAX_RETRIES="0",
                     CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK="1")


def claude_code_command(executable: Path, prompt: str, model: str, allowed_tools: tuple[str, ...] = ()) -> list[str]:
    # As root (CI containers), --dangerously-skip-permissions is refused; --allowedTools lets the
    # named tools run without a prompt, which -p mode could not answer.
    allowed = ["--allowedTools", ",".join(allowed_tools)] if allowed_tools else []
    return [str(executable), "-p", prompt, "--output-format", "json", "--model", model, *allowed]


# ---- Codex ------------------------------------------------------------------------------------

def write_codex_home(folder: Path, base_url: str, model: str, *, websockets: bool = False) -> Path:
    """A CODEX_HOME whose config.toml points Codex at `base_url` (…/v1) over the Responses API, with
    the model metadata from the server's own catalog (as the README tells users to set it up)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"model = {json.dumps(model)}", 'model_provider = "dflash"',
             "[model_providers.dflash]", 'name = "dflash"', f"base_url = {json.dumps(base_url)}",
             'wire_api = "responses"', 'env_key = "DFLASH_API_KEY"',
             f"model_catalog_url = {json.dumps(base_url + '/models')}",
             # A failure is the test's answer; retries would only make it slower to arrive.
             "request_max_retries = 0", "stream_max_retries = 0",
             f"supports_websockets = {json.dumps(websockets)}"]
    (folder / "config.toml").write_text("\n".join(lines) + "\n")
    return folder


def codex_env(home: Path, codex_home: Path) -> dict[str, str]:
    return clean_env(home, CODEX_HOME=str(codex_home), DFLASH_API_KEY=API_KEY)


def codex_command(executable: Path, prompt: str, *, run_tools: bool = False) -> list[str]:
    # Tools need --dangerously-bypass-approvals-and-sandbox: exec mode cannot ask for approval.
    bypass = ["--dangerously-bypass-approvals-and-sandbox"] if run_tools else []
    return [str(executable), "exec", "--skip-git-repo-check", "--ephemeral", "--json", *bypass, prompt]


def codex_events(stdout: str) -> list[dict]:
    """`codex exec --json` writes one event per line (other lines are its notes for humans)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def codex_failures(events: list[dict]) -> list[dict]:
    """Stream errors, failed turns and `error` items (warnings, such as model metadata Codex could
    not find in the server's catalog)."""
    return [event for event in events if event["type"] in ("error", "turn.failed")
            or (event["type"] == "item.completed" and event["item"]["type"] == "error")]


def codex_messages(events: list[dict]) -> list[str]:
    """The agent's messages, in order: its answer is the last."""
    return [event["item"]["text"] for event in events
            if event["type"] == "item.completed" and event["item"]["type"] == "agent_message"]


def outcome(done: subprocess.CompletedProcess) -> str:
    """A finished CLI run, for an assertion message."""
    return f"exit {done.returncode}\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"


def run_cli(command: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run a CLI to its end, stdin closed (both would otherwise wait for more input)."""
    return subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout_s)
