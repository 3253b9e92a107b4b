"""The default prompt set for `dflash train-drafter`, built offline from text that ships with Python:
chat questions about the standard library, coding tasks from its docstrings, code-editing turns
over its own small functions, and tool-use style turns; then (`EXTRA_CHAT` and more modules) everyday
chat and more of the same, appended after the first set so that a prompt's index, which names its
reply shard, stays the same when the count grows."""

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


# Everyday questions for chat replies (the drafter's weakest prompt type). Written for this list;
# none is one of unseen.py's prompts.
_DIFFERENCES = [("a virus", "bacteria"), ("baking soda", "baking powder"), ("a crocodile", "an alligator"),
                ("a simile", "a metaphor"), ("speed", "velocity"), ("renting", "buying a home"), ("jam", "jelly"),
                ("a hurricane", "a tornado"), ("an asteroid", "a comet"), ("a latte", "a cappuccino"),
                ("a resume", "a cover letter"), ("a frog", "a toad"), ("stocks", "bonds"), ("a sea", "an ocean"),
                ("empathy", "sympathy"), ("a violin", "a viola"), ("RAM", "disk storage"), ("a moth", "a butterfly")]
_TIPS = ["learning a new language", "sleeping better", "running a first 5K", "saving money each month",
         "writing a persuasive essay", "giving a presentation", "keeping houseplants alive", "reading more books",
         "preparing for a job interview", "taking better photos with a phone", "traveling with a small child",
         "starting to meditate", "studying for exams", "making friends in a new city", "learning to draw",
         "planning a vegetable garden", "reducing screen time", "cooking for one person", "staying hydrated",
         "running a good meeting"]
_EXPLAIN = ["photosynthesis", "inflation", "how vaccines work", "why the sky is blue", "how airplanes stay in the air",
            "compound interest", "the water cycle", "how a refrigerator keeps food cold", "what a black hole is",
            "how GPS finds your location", "how credit scores work", "why leaves change color in autumn",
            "how the heart pumps blood", "what DNA is", "how ocean tides work", "how solar panels make electricity",
            "supply and demand", "how bread dough rises", "what causes an eclipse", "how a bicycle stays upright"]
_WRITE = [("a short poem", "autumn leaves"), ("a short story", "a lost cat finding its way home"),
          ("a thank-you note", "a neighbour who watered my plants"), ("a short poem", "the ocean at night"),
          ("a short story", "a friendly robot in a bakery"), ("a birthday message", "my grandmother"),
          ("a short poem", "a rainy morning"), ("a product description", "a reusable water bottle"),
          ("a short story", "the first day at a new school"), ("an apology email", "missing a meeting")]
_PEOPLE = ["Marie Curie", "Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "Nelson Mandela", "Alan Turing",
           "Cleopatra", "Albert Einstein", "Jane Austen", "Charles Darwin", "Grace Hopper", "Galileo Galilei"]
_HOW_TO = ["boil an egg", "change a flat bicycle tire", "remove a coffee stain", "start a compost pile", "tie a tie",
           "make a good cup of tea", "back up my phone", "choose a laptop", "clean a cast-iron pan",
           "write a good email subject line", "fold a fitted sheet", "introduce myself at a networking event"]
EXTRA_CHAT = ([f"What is the difference between {a} and {b}?" for a, b in _DIFFERENCES]
              + [f"Give me some tips for {t}." for t in _TIPS]
              + [f"Explain {e} in simple terms." for e in _EXPLAIN]
              + [f"Write {form} about {subject}." for form, subject in _WRITE]
              + [f"Who was {p} and why are they famous?" for p in _PEOPLE]
              + [f"How do I {h}?" for h in _HOW_TO])
EXTRA_MODULES = ["collections", "datetime", "enum", "logging", "argparse", "subprocess", "tempfile", "hashlib",
                 "base64", "urllib.parse", "zipfile", "unittest", "decimal", "fractions", "copy", "gzip",
                 "configparser", "contextlib", "dataclasses", "typing", "inspect", "tokenize", "email.utils",
                 "mimetypes", "locale", "gettext", "platform", "sysconfig", "traceback", "warnings"]


def _functions(module_name: str):
    module = importlib.import_module(module_name)
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or not inspect.isfunction(value):
            continue
        yield f"{module_name}.{name}", value


def _module_prompts(modules: list[str]) -> list[str]:
    prompts = []
    for module_name in modules:
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
    return prompts


def python_topic_prompts() -> list[str]:
    """Questions about the language itself, one per topic of pydoc's help index."""
    from pydoc_data.topics import topics

    return [f"Explain the Python topic '{name}' with a short example." for name in sorted(topics)]


def default_prompts(limit: int = 400, seed: int = 0) -> list[str]:
    prompts = list(CHAT) + _module_prompts(MODULES)
    files = ["src/app.py", "tests/test_app.py", "README.md", "setup.cfg", "src/util.py"]
    for path in files:
        prompts.append(TOOL_TURNS[0].format(path=path))
    prompts.append(TOOL_TURNS[1].format(listing="\n".join(files)))
    rng = random.Random(seed)
    rng.shuffle(prompts)
    if limit <= len(prompts):
        return prompts[:limit]
    # A few prompts repeat (a function re-exported under two names has one docstring); they stay, so that
    # every index keeps naming the prompt it named when the README's runs were made.
    extra = EXTRA_CHAT + python_topic_prompts() + _module_prompts(EXTRA_MODULES)
    rng.shuffle(extra)
    return (prompts + extra)[:limit]
