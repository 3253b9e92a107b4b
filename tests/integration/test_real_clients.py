"""Codex and Claude Code, the real CLIs, through whole tool loops against the real server.

The server is `dflash.app.serve` with everything real but the model: a scripted engine
(tests/scripted_engine.py) writes each turn, in the embedded model's own tool-call format, so the
CLI really runs the tools (in a temporary folder), sends their results back, and ends on the
scripted answer. What a test checks is what a user would see (exit status, the answer, the edited
file) and what the server saw (each rendered prompt, recorded by the engine, and its log).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.protocols.responses import CODEX_BASE_INSTRUCTIONS
from tests.integration.clis import (claude_code_command, claude_code_env, codex_command, codex_env,
                                    codex_events, codex_failures, codex_messages, outcome, run_cli, write_codex_home)
from tests.integration.thread_server import ThreadServer, serving
from tests.scripted_engine import ScriptedEngine, Step, scripted_loader

MODEL = "smollm2-135m-instruct"
CLI_TIMEOUT_S = 120
NOTE = "The kettle on the third shelf is blue."
PATCHED_NOTE = "The kettle on the third shelf is green."
FINAL_ANSWER = "Done: the kettle is green now."
# What Codex answers a successful apply_patch call with.
PATCH_APPLIED = "Success. Updated the following files:\nM note.txt"
TOOL_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


@contextlib.contextmanager
def scripted_server(steps: list[Step]) -> Iterator[tuple[ScriptedEngine, ThreadServer]]:
    engine = ScriptedEngine(steps)
    with serving(scripted_loader(engine), engine.max_ctx) as server:
        yield engine, server


def call(name: str, arguments: dict) -> str:
    """A function call as the embedded model writes it (the built-in Hermes tool prompt's form)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def custom_call(name: str, text: str) -> str:
    """A call of a freeform (custom) tool: its raw input in the XML form, no JSON escaping."""
    return f"<tool_call>\n<function={name}>\n<parameter=input>\n{text}\n</parameter>\n</function>\n</tool_call>"


def tool_responses(prompt: str) -> list[str]:
    """The tool results in a rendered prompt, in order."""
    return TOOL_RESPONSE_RE.findall(prompt)


def test_claude_code_runs_bash_and_read_and_answers(claude_code, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text(NOTE + "\n")
    list_files = call("Bash", {"command": "ls", "description": "List the files"})
    read_note = call("Read", {"file_path": str(work / "note.txt")})
    task = "What does the file in this folder say?"
    steps = [Step(task, list_files), Step("note.txt", read_note), Step(NOTE, FINAL_ANSWER)]
    with scripted_server(steps) as (engine, server):
        done = run_cli(claude_code_command(claude_code, task, MODEL, allowed_tools=("Bash(ls:*)", "Read")),
                       cwd=work, env=claude_code_env(tmp_path / "home", server.base_url), timeout_s=CLI_TIMEOUT_S)

    assert done.returncode == 0, outcome(done)
    result = json.loads(done.stdout)
    assert (result["is_error"], result["result"]) == (False, FINAL_ANSWER), outcome(done)
    turns = engine.scripted_turns()
    assert [turn.reply for turn in turns] == [step.reply for step in steps]
    # The Bash result (the folder listing), then the Read result (the note, with line numbers).
    assert tool_responses(turns[1].prompt) == ["note.txt"]
    assert NOTE in tool_responses(turns[2].prompt)[-1]


def run_codex_edit(codex: Path, tmp_path: Path, *, websockets: bool):
    """Codex reads a note with its shell tool, rewrites it with apply_patch and answers."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text(NOTE + "\n")
    read_note = call("exec_command", {"cmd": "cat note.txt"})
    patch = custom_call("apply_patch", "*** Begin Patch\n*** Update File: note.txt\n@@\n"
                                       f"-{NOTE}\n+{PATCHED_NOTE}\n*** End Patch")
    task = "Make the kettle green."
    steps = [Step(task, read_note), Step(NOTE, patch), Step(PATCH_APPLIED, FINAL_ANSWER)]
    with scripted_server(steps) as (engine, server):
        codex_home = write_codex_home(tmp_path / "codex-home", f"{server.base_url}/v1", MODEL, websockets=websockets)
        done = run_cli(codex_command(codex, task, run_tools=True), cwd=work,
                       env=codex_env(tmp_path / "home", codex_home), timeout_s=CLI_TIMEOUT_S)
    return done, engine, server, work


def check_codex_edit(done: subprocess.CompletedProcess, engine: ScriptedEngine, work: Path) -> None:
    assert done.returncode == 0, outcome(done)
    events = codex_events(done.stdout)
    assert codex_failures(events) == [], outcome(done)
    assert codex_messages(events)[-1:] == [FINAL_ANSWER], outcome(done)
    assert (work / "note.txt").read_text() == PATCHED_NOTE + "\n"
    turns = engine.scripted_turns()
    assert [turn.reply for turn in turns] == [step.reply for step in engine.steps]
    assert NOTE in tool_responses(turns[1].prompt)[-1]
    assert PATCH_APPLIED in tool_responses(turns[2].prompt)[-1]


def test_codex_runs_a_shell_command_and_applies_a_patch(codex, tmp_path):
    done, engine, server, work = run_codex_edit(codex, tmp_path, websockets=False)
    check_codex_edit(done, engine, work)
    # The apply_patch tool and the short instructions come from the server's catalog.
    assert [line["status"] for line in server.requests("/v1/models")] == [200]
    assert CODEX_BASE_INSTRUCTIONS in engine.scripted_turns()[0].prompt


def test_codex_over_websocket_chains_turns_by_previous_response_id(codex, tmp_path):
    done, engine, server, work = run_codex_edit(codex, tmp_path, websockets=True)
    check_codex_edit(done, engine, work)
    assert "Falling back" not in done.stdout + done.stderr, outcome(done)
    # Today's server answers the upgrade with 426, and Codex quietly posts over HTTP instead.
    assert [line for line in server.requests("/v1/responses") if line["method"] == "POST"] == []
    # The two requests after the tool results continue the one before (the server logs the id it
    # continued, for each response it creates).
    chained = [event["previous_response_id"] for event in server.log if event.get("previous_response_id")]
    assert len(chained) >= 2, server.log
