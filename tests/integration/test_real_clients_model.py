"""Codex and Claude Code against the embedded model, served as a user starts it: examples/default.toml
(on a free port, with a disk cache of its own). Each CLI must finish a one-line task with a
non-empty answer and no error. One outcome is the model's, not ours, and is reported as an expected
failure: Codex's turn cut at the default max_output_tokens because the greedy reply repeated itself
to the cap (it did so in CI on a CPU other than the one these tests were written on).

The CLIs' first requests are long (Codex ~5.5K tokens with the server's catalog, Claude Code ~20K),
and the whole prompt is prefilled on the CPU: about a minute for Codex, many for Claude Code.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import attrs
import pytest

from dflash.protocols.canonical import DEFAULT_MAX_TOKENS
from tests.integration.clis import (claude_code_command, claude_code_env, codex_command, codex_env, codex_events,
                                    codex_failures, codex_messages, outcome, run_cli, write_codex_home)
from tests.integration.conftest import ROOT, running_server

# Claude Code on the embedded model: its first request with all tools is ~20K tokens, past the
# model's trained 8K (minutes of prefill on a 2-core CPU), and the 135M model's greedy reply
# degenerates into repetition instead of ending, with all tools or three (README, Coding agents).
slow_client = pytest.mark.skipif(not os.environ.get("DFLASH_SLOW_CLIENT_TESTS"),
                                 reason="Claude Code on the embedded model: minutes of prefill and a reply that "
                                        "does not end (model quality); DFLASH_SLOW_CLIENT_TESTS=1 runs it")
TASK = "Say hello in one word."
CODEX_TIMEOUT_S = 600
CLAUDE_CODE_TIMEOUT_S = 900


def default_config(disk_dir: Path) -> str:
    """examples/default.toml as shipped, but on a free port and with a disk cache of its own."""
    text = (ROOT / "examples" / "default.toml").read_text()
    for setting, value in (("port = 8000", "port = 0"), ('disk_dir = ""', f"disk_dir = {json.dumps(str(disk_dir))}")):
        assert text.count(setting) == 1, f"examples/default.toml no longer has exactly one {setting!r}"
        text = text.replace(setting, value)
    return text


@attrs.frozen
class DefaultServer:
    base_url: str
    model: str
    log_path: Path
    cpu: str  # the CPU kind it names at start-up (its kernels, and so the model's greedy replies, follow it)

    def requests(self) -> list[dict]:
        """The request lines of its log so far."""
        lines = (json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{"))
        return [line for line in lines if line.get("event") == "request"]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory) -> DefaultServer:
    folder = tmp_path_factory.mktemp("default-server")
    with running_server(folder, default_config(folder / "disk-cache")) as started:
        yield DefaultServer(started["listening"], started["model"], folder / "server.log", started["cpu"])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The folder every CLI here works in: the CLIs write it into their prompts, so with one folder
    the second Codex run's prompt is the first one's, which the server's prompt cache holds (a
    9K-token prefill saved)."""
    return tmp_path_factory.mktemp("workspace")


def run_codex(codex: Path, tmp_path: Path, workspace: Path, server: DefaultServer, *, websockets: bool):
    # One CODEX_HOME for both runs too: Codex writes its path into the prompt (the skills' root).
    codex_home = write_codex_home(workspace.parent / "codex-home", f"{server.base_url}/v1", server.model,
                                  websockets=websockets)
    return run_cli(codex_command(codex, TASK), cwd=workspace, env=codex_env(tmp_path / "home", codex_home),
                   timeout_s=CODEX_TIMEOUT_S)


def check_codex_answer(done: subprocess.CompletedProcess, server: DefaultServer, seen_before: int) -> None:
    events = codex_events(done.stdout)
    generated = [line for line in server.requests()[seen_before:] if "finish_reason" in line]
    if done.returncode != 0 and talked_to_the_cap(events, generated):
        # The 135M model's greedy reply depends on the CPU's arithmetic and on the prompt (Codex
        # writes the date and these temporary paths into it); on some it repeats a phrase until
        # the default max_output_tokens. The server and Codex both did their part: the reply
        # streamed, ended "incomplete", and Codex said why. Any other failure fails the test.
        pytest.xfail(f"the embedded model's reply did not end within {DEFAULT_MAX_TOKENS} tokens "
                     f"(model quality on this CPU and date; the protocol held); prompt {generated[-1]['prompt_tokens']} "
                     f"tokens, cpu {server.cpu}")
    assert done.returncode == 0, outcome(done)
    assert codex_failures(events) == [], outcome(done)
    messages = codex_messages(events)
    assert messages and messages[-1].strip(), outcome(done)
    assert generated and generated[-1]["finish_reason"] == "stop", generated


def talked_to_the_cap(events: list[dict], generated: list[dict]) -> bool:
    """Codex's only complaint is the cut reply, and the server cut it at the default cap."""
    complaints = {event.get("message") or event.get("error", {}).get("message") for event in codex_failures(events)}
    return (complaints == {"Incomplete response returned, reason: max_output_tokens"} and bool(generated)
            and generated[-1]["finish_reason"] == "length" and generated[-1]["completion_tokens"] == DEFAULT_MAX_TOKENS)


def test_codex_answers_with_the_embedded_model(codex, tmp_path, workspace, default_server):
    seen_before = len(default_server.requests())
    done = run_codex(codex, tmp_path, workspace, default_server, websockets=False)
    check_codex_answer(done, default_server, seen_before)


def test_codex_over_websocket_answers_with_the_embedded_model(codex, tmp_path, workspace, default_server):
    seen_before = len(default_server.requests())
    done = run_codex(codex, tmp_path, workspace, default_server, websockets=True)
    assert "Falling back" not in done.stdout + done.stderr, outcome(done)
    # A refused upgrade makes Codex quietly post over HTTP instead.
    posted = [line for line in default_server.requests()[seen_before:] if line["method"] == "POST"]
    assert posted == [], outcome(done)
    check_codex_answer(done, default_server, seen_before)


def run_claude_code(claude_code: Path, tmp_path: Path, workspace: Path, server: DefaultServer,
                    extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return run_cli([*claude_code_command(claude_code, TASK, server.model), *extra], cwd=workspace,
                   env=claude_code_env(tmp_path / "home", server.base_url), timeout_s=CLAUDE_CODE_TIMEOUT_S)


def check_claude_code_answer(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, outcome(done)
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["result"].strip(), outcome(done)


@slow_client
def test_claude_code_with_a_small_tool_set_answers_with_the_embedded_model(claude_code, tmp_path, workspace,
                                                                            default_server):
    """Three tools make a ~3.1K-token first turn, inside the model's trained context, instead of
    ~20K, which the default set-up serves unscaled since session 39 (rope_scaling_static = false).
    On AVX2 (AMD EPYC Zen 3) it passed there in 47 s; with the scaling static the greedy reply
    repeated a line of the system reminder until the 900 s timeout (README, Coding agents). Kept
    opt-in: the reply follows the CPU's arithmetic, unmeasured on the other kinds."""
    seen_before = len(default_server.requests())
    check_claude_code_answer(run_claude_code(claude_code, tmp_path, workspace, default_server,
                                             ("--tools", "Bash,Read,Edit")))
    asked = [line for line in default_server.requests()[seen_before:] if line["path"] == "/v1/messages"]
    assert asked and all(line["prompt_tokens"] < 8192 for line in asked), asked


@slow_client
def test_claude_code_answers_with_the_embedded_model(claude_code, tmp_path, workspace, default_server):
    check_claude_code_answer(run_claude_code(claude_code, tmp_path, workspace, default_server))
