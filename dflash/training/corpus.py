"""The offline text the drafter is teacher-forced on: all of it ships with Python, nothing is downloaded.

Three kinds of document, mixed by token share (`DEFAULT_MIX`):
- `source`: the standard library's own modules (code as agents read and write it);
- `docs`: pydoc's plain-text documentation of well-known modules (prose about code);
- `agent`: coding-agent turns rendered through the target's chat template with the built-in tool
  prompt: a tool call reads a standard-library function, its source comes back as a tool
  result, and the reply writes the edited function out in full (code edits that echo code).

Documents are cut into windows of at most `window` tokens; `corpus_windows` yields them in one fixed
order for given settings, so a window's index names the same tokens in every run (resumable shards).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pydoc
import random
import re
import sysconfig
from pathlib import Path
from typing import Callable, Iterator

from dflash.chat.template import builtin_call_text, builtin_tool_prompt, render_text
from dflash.protocols.canonical import ToolCall, ToolSpec

DEFAULT_MIX = {"source": 0.4, "docs": 0.2, "agent": 0.4}
MIN_WINDOW_TOKENS = 64  # shorter tails teach little and cost a forward each
SKIPPED_PACKAGES = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
                    "dist-packages", "__pycache__", "pydoc_data", "config-3"}
DOC_MODULES = ["textwrap", "string", "json", "shutil", "pathlib", "itertools", "functools", "statistics", "difflib",
               "fnmatch", "glob", "heapq", "bisect", "calendar", "csv", "html", "ipaddress", "operator", "os",
               "pprint", "random", "re", "shlex", "uuid", "collections", "dataclasses", "datetime", "enum", "io",
               "logging", "argparse", "subprocess", "threading", "queue", "asyncio", "typing", "contextlib",
               "tempfile", "hashlib", "base64", "struct", "socket", "urllib.parse", "zipfile", "tarfile", "sqlite3",
               "unittest", "decimal", "fractions", "math", "time", "copy", "pickle", "gzip", "configparser"]
AGENT_TOOLS = [
    ToolSpec("read_file", "Read a text file of the repository.",
             {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
    ToolSpec("write_file", "Replace a file's whole content.",
             {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
              "required": ["path", "content"]}),
    ToolSpec("run", "Run a shell command in the repository and return its output.",
             {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
]
AGENT_SYSTEM = "You are a coding agent working in the user's repository. Make the change asked for, then check it.\n\n"


def stdlib_sources() -> Iterator[str]:
    """Every standard-library module's source, in path order, skipping tests, GUIs and data."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_PACKAGES.intersection(path.relative_to(root).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            yield text


def stdlib_docs() -> Iterator[str]:
    for name in DOC_MODULES:
        try:
            module = importlib.import_module(name)
            yield pydoc.render_doc(module, renderer=pydoc.plaintext)
        except Exception:  # a module missing from this build of Python: skip it, the mix stays offline
            continue


def _functions() -> Iterator[tuple[str, str, str]]:
    """(module path, function name, source) of small standard-library functions, in a fixed order."""
    for module_name in DOC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, value in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(value) or value.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(value)
            except (OSError, TypeError):
                continue
            if 4 <= source.count("\n") <= 60 and source.startswith("def "):
                yield module_name.replace(".", "/") + ".py", name, source


def _renamed(source: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, source)


def _with_docstring(source: str, summary: str) -> str:
    header, _, body = source.partition(":\n")
    indent = re.match(r"\s*", body).group(0) or "    "
    if body.lstrip().startswith(('"""', "'''")):
        return source
    return f'{header}:\n{indent}"""{summary}"""\n{body}'


def agent_conversations(tokenizer, seed: int = 0, rounds: int = 4) -> Iterator[str]:
    """Rendered agent turns over the small standard-library functions, `rounds` times with other
    edits and endings each time (see the module docstring)."""
    rng = random.Random(seed)
    system = AGENT_SYSTEM + builtin_tool_prompt(AGENT_TOOLS)
    functions = list(_functions())
    for path, name, source in (f for _ in range(rounds) for f in functions):
        if rng.random() < 0.5:
            new_name = f"{name}_v2" if rng.random() < 0.5 else f"compute_{name}"
            ask, edited = f"Rename `{name}` to `{new_name}` in {path}.", _renamed(source, name, new_name)
        else:
            summary = f"{name.replace('_', ' ').capitalize()}."
            ask, edited = f"Add a one-line docstring to `{name}` in {path}.", _with_docstring(source, summary)
        read = builtin_call_text(ToolCall(id="", name="read_file", arguments=json.dumps({"path": path})))
        if rng.random() < 0.5:
            answer = f"Here is the updated function:\n\n```python\n{edited}```"
        else:
            answer = builtin_call_text(ToolCall(id="", name="write_file",
                                                arguments=json.dumps({"path": path, "content": edited})))
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": ask},
            {"role": "assistant", "content": read},
            {"role": "user", "content": f"<tool_response>\n{source}</tool_response>"},
            {"role": "assistant", "content": answer},
        ]
        if rng.random() < 0.3:
            test = builtin_call_text(ToolCall(id="", name="run", arguments=json.dumps({"command": "python -m pytest -q"})))
            messages += [{"role": "user", "content": f"<tool_response>\n{rng.randint(3, 60)} passed\n</tool_response>"},
                         {"role": "assistant", "content": test}]
        yield render_text(tokenizer, messages, add_generation_prompt=False)


def _windows(documents: Iterator[str], encode: Callable[[str], list[int]], window: int) -> Iterator[list[int]]:
    for text in documents:
        ids = encode(text)
        for start in range(0, len(ids), window):
            piece = ids[start : start + window]
            if len(piece) >= MIN_WINDOW_TOKENS:
                yield piece


def corpus_windows(tokenizer, window: int = 1024, mix: dict[str, float] | None = None,
                   seed: int = 0) -> Iterator[tuple[str, list[int]]]:
    """(kind, token ids) windows, interleaved so every prefix of the stream holds the kinds in about
    the `mix` shares of tokens; a kind that runs out leaves the others to continue."""
    mix = checked_mix(DEFAULT_MIX if mix is None else mix)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    sources: dict[str, Iterator[str]] = {"source": stdlib_sources(), "docs": stdlib_docs(),
                                         "agent": agent_conversations(tokenizer, seed)}
    streams = {kind: _windows(sources[kind], encode, window) for kind in mix}
    emitted = {kind: 0 for kind in mix}
    while streams:
        kind = min(streams, key=lambda k: (emitted[k] / mix[k], k))
        piece = next(streams[kind], None)
        if piece is None:
            del streams[kind]
            continue
        emitted[kind] += len(piece)
        yield kind, piece


def checked_mix(mix: dict[str, float]) -> dict[str, float]:
    if not mix or set(mix) - set(DEFAULT_MIX) or any(share <= 0 for share in mix.values()):
        raise ValueError(f"corpus mix {mix!r}: kinds are {sorted(DEFAULT_MIX)} with positive shares")
    return dict(mix)


def parse_mix(text: str) -> dict[str, float]:
    """`source=0.4,docs=0.2,agent=0.4` (the --corpus-mix flag) into shares."""
    mix = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, share = item.partition("=")
        try:
            mix[kind.strip()] = float(share)
        except ValueError:
            raise ValueError(f"corpus mix item {item!r}: expected kind=share, e.g. source=0.4") from None
    return checked_mix(mix)


