"""The default prompt set for `dflash train-drafter`, built offline from text that ships with Python:
chat questions about the standard library, coding tasks from its docstrings, code-editing turns
over its own small functions, and tool-use style turns."""

from __future__ import annotations

import importlib
import inspect
import random

MODULES = ["textwrap", "string", "json", "shutil", "pathlib", "itertools", "functools", "statistics",
           "difflib", "fnmatch", "glob", "heapq", "bisect", "calendar", "colorsys", "csv", "html",
           "ipaddress", "keyword", "operator", "os.path", "pprint", "random", "re", "shlex", "uuid"]
CHAT = [
    "What is the difference between a list and a tuple in Python?", "Explain recursion to a beginner.",
    "What are three good habits for writing maintainable code?", "How does a hash table work?",
    "What is a race condition?", "Explain what an API is in two sentences.",
    "Why are unit tests useful?", "What does HTTP status 404 mean?", "Name three sorting algorithms.",
    "What is the capital of Japan?", "Give me a tip for writing clear commit messages.",
    "What is the difference between a process and a thread?",
]
TOOL_TURNS = [
    'You can call tools. To read a file, answer with <tool_call>{{"name": "read_file", "arguments": {{"path": "{path}"}}}}</tool_call>. Read {path}.',
    "Here is the output of `ls`:\n{listing}\nWhich file most likely holds the tests?",
]


def _functions(module_name: str):
    module = importlib.import_module(module_name)
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or not inspect.isfunction(value):
            continue
        yield f"{module_name}.{name}", value


def default_prompts(limit: int = 400, seed: int = 0) -> list[str]:
    prompts = list(CHAT)
    for module_name in MODULES:
        for qualified, function in _functions(module_name):
            doc = (inspect.getdoc(function) or "").strip().splitlines()
            if doc:
                prompts.append(f"Explain what the Python function `{qualified}` does: {doc[0]}")
                prompts.append(f"Write a short Python function that does this: {doc[0]}")
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if 3 <= source.count("\n") <= 25:
                prompts.append(f"Add a docstring to this function and print the whole function again:\n\n{source}")
                prompts.append(f"Rename the local variables of this function to clearer names:\n\n{source}")
    files = ["src/app.py", "tests/test_app.py", "README.md", "setup.cfg", "src/util.py"]
    for path in files:
        prompts.append(TOOL_TURNS[0].format(path=path))
    prompts.append(TOOL_TURNS[1].format(listing="\n".join(files)))
    rng = random.Random(seed)
    rng.shuffle(prompts)
    return prompts[:limit]
