"""A large prompt pool for training a drafter at scale (at_scale.py): tens of thousands of
conversations, built offline and deterministically from text that ships with Python and word lists
written here, in the four kinds the unseen prompts measure (unseen.py).

- `chat`: the built-in set's chat (prompts.py) and everyday asks combined from the word lists below;
  past the plain asks, the same asks again with a style note ("Keep it short.").
- `coding`: tasks from the docstrings of standard-library functions, classes and methods across
  about a hundred pure-Python modules, asked in many shapes, and generic tasks from word lists.
- `code editing`: an instruction, a blank line, then the source of a standard-library function,
  method or small class (3 to 40 lines, dedented), sometimes in a ```python fence.
- `tool use`: the built-in tool prompt with one of a few tool sets, an ask about a file, and either
  nothing more (the model should call a tool) or a call with its result: real standard-library
  source, a search hit, a directory listing or command output.

The standard library is read by parsing its source files (ast), not by importing the modules: no
module code runs (webbrowser, antigravity), and what is found does not depend on what happens to
be imported. On Python 3.11 the unique supply is about: chat 4.5K plain asks, 58K with the style
notes; coding 2.7K items (2.4K docstrings, 0.3K generic tasks), 24K asks in all; code editing 3.2K
sources, 45K (source, instruction) pairs, x2 with and without the fence; tool use 3.7K functions and
classes, each round with another ask, tool set and file name. So 50,000 conversations hold 49,999
distinct ones; past ~100,000, coding starts to repeat (a repeat is taken after 20 tries).

None of unseen.py's prompts, nor its code (the `Inventory` class, `parse_duration`), is in the
pool: the word lists avoid their subjects and every conversation is checked against them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import random
import textwrap
from typing import Callable, Iterator

from dflash.chat.template import builtin_call_text, builtin_tool_prompt
from dflash.protocols.canonical import ToolCall, ToolSpec
from dflash.training.prompts import CHAT, EVERYDAY_CHAT, EXTRA_CHAT, python_topic_prompts

KINDS = ("chat", "coding", "code editing", "tool use")
DEFAULT_SHARES = {"chat": 0.25, "coding": 0.25, "code editing": 0.3, "tool use": 0.2}
MAX_CHARS = 2400  # a conversation's text past this (~700 tokens of code with the tool prompt) is dropped

# Pure-Python modules whose functions and docstrings the coding, editing and tool kinds draw on.
# A module missing from this build of Python is skipped.
POOL_MODULES = [
    "textwrap", "string", "json", "json.decoder", "json.encoder", "shutil", "pathlib", "functools", "statistics",
    "difflib", "fnmatch", "glob", "heapq", "bisect", "calendar", "colorsys", "csv", "html", "html.parser",
    "ipaddress", "keyword", "operator", "posixpath", "ntpath", "genericpath", "pprint", "random", "re", "shlex",
    "uuid", "collections", "datetime", "enum", "logging", "logging.handlers", "argparse", "subprocess", "tempfile",
    "hashlib", "base64", "urllib.parse", "urllib.request", "zipfile", "unittest.case", "unittest.mock", "decimal",
    "fractions", "copy", "gzip", "configparser", "contextlib", "dataclasses", "typing", "inspect", "tokenize",
    "email.utils", "email.message", "email.header", "mimetypes", "locale", "gettext", "platform", "sysconfig",
    "traceback", "warnings", "ast", "cmd", "code", "codecs", "dis", "filecmp", "fileinput", "ftplib", "getopt",
    "getpass", "graphlib", "hmac", "http.cookies", "http.client", "http.server", "imaplib", "mailbox", "netrc",
    "numbers", "optparse", "pickle", "pkgutil", "plistlib", "poplib", "queue", "quopri", "reprlib", "sched",
    "secrets", "selectors", "shelve", "smtplib", "socketserver", "stat", "tarfile", "threading", "timeit", "trace",
    "tracemalloc", "types", "wave", "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree", "zipapp",
    "zoneinfo._zoneinfo", "abc", "asyncio.queues", "asyncio.locks", "concurrent.futures._base", "contextvars",
    "dbm.dumb", "io", "linecache", "lzma", "bz2", "nturl2path", "opcode", "os", "pstats", "py_compile", "pydoc",
    "rlcompleter", "runpy", "sqlite3.dbapi2", "struct", "symtable", "tabnanny", "tomllib._parser",
    "urllib.robotparser", "wsgiref.util", "wsgiref.headers", "xml.sax.saxutils", "importlib.metadata",
    "importlib.resources._common", "json.tool",
]


# -- chat: word lists written for this pool (none is an unseen prompt's subject) -------------------

_HOBBIES = ["bouldering", "origami", "beekeeping", "calligraphy", "woodworking", "stargazing", "sourdough baking",
            "bird photography", "trail running", "home brewing kombucha", "embroidery", "bonsai", "geocaching",
            "sketching people in cafes", "fly fishing", "learning the ukulele", "bread baking", "model trains",
            "scuba diving", "crossword puzzles", "board game design", "urban gardening", "candle making",
            "salsa dancing", "archery", "podcasting", "mountain biking", "wild swimming", "film photography",
            "collecting vinyl records", "soap making", "cross-stitch", "hula hooping", "foraging for mushrooms",
            "stand-up paddleboarding", "chess puzzles", "drawing comics", "learning magic tricks", "quilting",
            "leather crafting", "amateur astronomy", "choir singing", "table tennis", "sailing", "crochet",
            "writing short stories", "restoring old furniture", "keeping chickens", "playing the harmonica",
            "growing herbs indoors"]
_HOBBY_ASKS = ["How do I get started with {}?", "What equipment do I need for {}?",
               "How can I get better at {} in a month?", "Is {} a good hobby for someone who works long hours?",
               "What do people enjoy most about {}?"]
_SCIENCE = ["black holes", "plate tectonics", "the human microbiome", "quantum entanglement", "photosynthesis in algae",
            "the Big Bang", "how vaccines train the immune system", "antibiotic resistance", "the greenhouse effect",
            "dark matter", "how the brain stores memories", "the Doppler effect", "nuclear fusion in the sun",
            "how batteries store energy", "the life cycle of a star", "how lightning forms", "ocean currents",
            "CRISPR gene editing", "how bats use echolocation", "the structure of an atom", "superconductors",
            "the theory of relativity", "how rainbows form", "why ice floats", "how earthquakes are measured",
            "the carbon cycle", "how birds fly", "the periodic table", "how lasers work", "why we have seasons",
            "the Fibonacci sequence in nature", "how fireflies glow", "the ozone layer", "how telescopes work",
            "why metals conduct electricity", "how soap removes dirt", "the speed of sound", "how tides are predicted",
            "how glaciers move", "how octopuses change color", "cell division", "how hearing works",
            "why the moon has craters", "how magnets work", "how clouds form", "entropy", "how coral reefs grow",
            "why some animals hibernate", "how rockets reach orbit", "how 3D printers work"]
_SCIENCE_ASKS = ["How does {} work?", "Explain {} to a twelve-year-old.", "Give me three surprising facts about {}.",
                 "Summarize what we know about {} in a short paragraph.", "What is a common myth about {}?"]
_HISTORY = ["the fall of the Roman Empire", "the invention of the printing press", "the French Revolution",
            "the Industrial Revolution", "the Apollo 11 moon landing", "the building of the Great Wall of China",
            "the Black Death", "the Renaissance in Italy", "the Silk Road", "the fall of the Berlin Wall",
            "the Magna Carta", "the age of the Vikings", "the construction of the pyramids of Giza",
            "the American Civil War", "the Meiji Restoration", "the discovery of penicillin",
            "the first transatlantic telegraph", "the Ottoman Empire", "the Aztec capital Tenochtitlan",
            "the Protestant Reformation", "the partition of India", "the Cuban Missile Crisis",
            "the Wright brothers' first flight", "the Library of Alexandria", "the Mongol Empire",
            "the abolition of slavery in Britain", "the Hundred Years' War", "the Gold Rush in California",
            "the invention of the telephone", "the first Olympic Games", "the Spanish flu of 1918",
            "the Inca road system", "the Dust Bowl", "the Marshall Plan", "the signing of the Treaty of Versailles",
            "the women's suffrage movement", "the early history of the internet", "ancient Greek democracy",
            "the Ming dynasty's treasure fleets", "the Scientific Revolution"]
_HISTORY_ASKS = ["What caused {}?", "Summarize {} in a few sentences.", "Why does {} still matter today?",
                 "What was daily life like during {}?"]
_DISHES = ["shakshuka", "pad thai", "lasagna", "a lentil soup", "chicken tikka masala", "ratatouille", "paella",
           "falafel", "a beef stew", "ramen", "a quiche", "a Caesar salad", "tacos al pastor", "a mushroom risotto",
           "gazpacho", "pierogi", "a vegetable lasagna", "bibimbap", "a banana smoothie", "French toast",
           "a carrot cake", "focaccia", "dumplings", "a chickpea curry", "a frittata", "pesto pasta", "a cheesecake",
           "gnocchi", "a lemon tart", "fish tacos", "a minestrone", "baked salmon", "a tomato sauce from scratch",
           "cornbread", "a black bean burger", "a pumpkin soup", "oatmeal cookies", "a Thai green curry",
           "a couscous salad", "crepes", "a chocolate mousse", "a potato gratin", "a cold brew coffee",
           "a spinach pie", "an egg fried rice"]
_DISH_ASKS = ["Give me a simple recipe for {}.", "What is the secret to good {}?", "How can I make {} healthier?",
              "What side dishes go well with {}?", "Where does {} come from?"]
_DESTINATIONS = ["Lisbon", "Hokkaido", "Cusco", "Marrakesh", "Tasmania", "Ljubljana", "Quebec City", "Oaxaca",
                 "Seville", "the Faroe Islands", "Hanoi", "Copenhagen", "the Dolomites", "Zanzibar", "Kraków",
                 "Jordan's Petra", "Sri Lanka", "Tallinn", "the Canadian Rockies", "Porto", "Seoul", "Crete",
                 "the Isle of Skye", "Cartagena", "Budapest", "Yellowstone", "Rajasthan", "Bruges", "Kyrgyzstan",
                 "the Azores", "Valparaíso", "Malta", "Tbilisi", "Hoi An", "Bergen", "Sicily", "Chiang Mai",
                 "Namibia", "Montreal", "the Lofoten Islands", "Dubrovnik", "Lake Bled", "Salzburg", "Kerala",
                 "Santorini"]
_DESTINATION_ASKS = ["Plan a three-day itinerary for {}.", "What is the best time of year to visit {}?",
                     "What food should I try in {}?", "What should I pack for a trip to {}?",
                     "How can I visit {} on a budget?"]
_SITUATIONS = ["a disagreement with a coworker", "nerves before a job interview", "a noisy neighbor",
               "a friend who always cancels plans", "too many commitments at once", "a long commute",
               "a tight monthly budget", "a difficult conversation with my manager", "moving to a new city alone",
               "a roommate who never cleans", "procrastinating on a big project", "a fear of public speaking",
               "burnout at work", "a child who refuses to eat vegetables", "jet lag after a long flight",
               "a breakup", "feeling lonely in a new job", "a messy garage", "planning a family reunion",
               "asking for a raise", "a teenager who spends all day on the phone", "saying no to extra work",
               "an argument with my sister", "starting a new exercise routine", "a slow home internet connection",
               "a missed deadline", "a dog that barks at night", "a group project where nobody helps",
               "keeping in touch with old friends", "writing my first resume", "a cluttered email inbox",
               "getting up earlier in the morning", "learning to cook after years of takeout",
               "a rejection letter", "a long wait for test results", "a friend's birthday I forgot",
               "a landlord who ignores repairs", "choosing between two job offers", "a fear of flying",
               "a sore back from sitting all day"]
_SITUATION_ASKS = ["How should I deal with {}?", "What are some practical steps for handling {}?",
                   "A friend asked me for advice about {}. What should I tell them?"]
_FORMS = ["a short poem", "a haiku", "a limerick", "a short story", "a six-word story", "a song chorus",
          "a short letter", "a postcard message", "a diary entry", "a product review", "a short speech",
          "a fairy tale opening", "a news headline and first paragraph", "a riddle", "a tongue twister",
          "a motivational quote", "a short dialogue", "a bedtime story", "an acrostic poem", "a sonnet"]
_SUBJECTS = ["a lighthouse in a storm", "the first day of spring", "a lost umbrella", "a cat watching the rain",
             "an old bicycle", "a busy train station", "the smell of fresh bread", "a forgotten library book",
             "a snowy mountain village", "a grandmother's garden", "a robot learning to paint", "a summer festival",
             "a quiet morning at the lake", "a kite stuck in a tree", "a city bus at midnight", "a jar of honey",
             "a sailor coming home", "an owl in the attic", "the last leaf on a tree", "a broken clock",
             "a campfire under the stars", "a street musician", "a penguin on holiday", "a field of sunflowers",
             "the sound of the sea", "a shy dragon", "a paper boat", "a rainy Monday", "a trip to the moon",
             "a school lunchbox", "a lonely astronaut", "a windmill", "a dog waiting at the door",
             "the end of a long journey", "a tiny house in the woods", "a bakery at dawn", "a marathon runner",
             "a pair of old boots", "a treehouse", "the northern lights"]
_WRITE_ASKS = ["Write {} about {}.", "Can you write {} about {}?"]
_ANIMALS = ["octopuses", "elephants", "honeybees", "penguins", "wolves", "sea otters", "hummingbirds", "giraffes",
            "axolotls", "crows", "dolphins", "tardigrades", "snow leopards", "koalas", "platypuses", "orcas",
            "monarch butterflies", "camels", "owls", "ants", "sloths", "flamingos", "chameleons", "beavers",
            "pandas", "jellyfish", "parrots", "hedgehogs", "sharks", "salmon", "bats", "tortoises", "lions",
            "squirrels", "hermit crabs", "cuttlefish", "polar bears", "meerkats", "whales", "seahorses"]
_ANIMAL_ASKS = ["Tell me some interesting facts about {}.", "Where do {} live and what do they eat?",
                "How do {} communicate with each other?"]
_SKILLS = ["handwriting", "public speaking", "memory", "posture", "typing speed", "listening skills",
           "time management", "negotiation skills", "focus while reading", "sleep schedule", "vocabulary",
           "mental math", "drawing skills", "singing voice", "photography", "chess game", "running pace",
           "cooking skills", "writing style", "patience", "confidence", "note-taking", "spelling",
           "sense of direction", "balance", "flexibility", "email etiquette", "budgeting", "decision making",
           "small talk"]
_SKILL_ASKS = ["How can I improve my {}?", "What is a daily exercise that helps my {}?"]
_WORDS = ["serendipity", "melancholy", "nostalgia", "ubiquitous", "ephemeral", "quarantine", "salary", "robot",
          "alphabet", "muscle", "disaster", "sabotage", "mortgage", "avocado", "berserk", "clue", "nice", "goodbye",
          "curfew", "companion", "sincere", "hazard", "jargon", "panic", "tragedy", "window", "tycoon", "vaccine",
          "quiz", "ketchup", "pajamas", "shampoo", "algebra", "candidate", "enthusiasm", "hypocrite", "lunatic",
          "sandwich", "trivia", "umpire"]
_WORD_ASKS = ["What does the word '{}' mean and where does it come from?",
              "Use the word '{}' in three example sentences."]
_THINGS = ["books", "board games", "podcasts", "houseplants", "card games", "documentaries", "hobbies", "snacks",
           "stretches", "gift ideas", "songs", "outdoor activities", "questions to ask", "easy recipes", "apps"]
_OCCASIONS = ["a long train ride", "a rainy weekend", "a family evening", "a first date", "a small apartment",
              "a ten-year-old", "a retired teacher", "a camping trip", "a dinner party", "a new college student",
              "a quiet evening alone", "a road trip with friends", "someone learning English", "a beach holiday",
              "a busy parent", "a team-building event", "a winter afternoon", "a picnic", "someone who loves history",
              "a person starting to run"]
_PAIRS = [("a crow", "a raven"), ("a cake", "a cookie"), ("a republic", "a monarchy"), ("a college", "a university"),
          ("a village", "a town"), ("a lake", "a reservoir"), ("mist", "fog"), ("a glacier", "an iceberg"),
          ("a crocodile", "a lizard"), ("baking", "roasting"), ("a boat", "a ship"), ("a violin", "a fiddle"),
          ("a herb", "a spice"), ("a rumor", "a fact"), ("a recession", "a depression"), ("a virus", "a worm"),
          ("jogging", "running"), ("a hobby", "a passion"), ("a goal", "a wish"), ("weight", "mass"),
          ("an opinion", "an argument"), ("a leader", "a manager"), ("a sprain", "a strain"), ("yogurt", "kefir"),
          ("a map", "a globe"), ("a comet", "a meteor"), ("a bee", "a wasp"), ("a forest", "a jungle"),
          ("a dolphin", "a porpoise"), ("a sweater", "a cardigan"), ("a meteor", "a meteorite"),
          ("an island", "a peninsula"), ("a river", "a stream"), ("a lemon", "a lime"), ("a dialect", "a language"),
          ("a fable", "a myth"), ("a pond", "a marsh"), ("a sprint", "a marathon"), ("a diary", "a journal"),
          ("a kitten", "a puppy as a first pet")]
_PAIR_ASKS = ["What is the difference between {} and {}?", "How can I tell {} from {}?"]
_MATH = [("If a train travels {a} kilometers in {b} hours, what is its average speed?", (60, 480, 2, 6)),
         ("What is {a}% of {b}? Show how you work it out.", (5, 60, 40, 900)),
         ("A recipe for {b} people needs {a} grams of flour. How much do I need for {c} people?", (150, 600, 2, 6)),
         ("I save {a} dollars a week. How many weeks until I have {b} dollars?", (15, 90, 300, 3000)),
         ("A shirt costs {b} dollars and is {a}% off. What is the sale price?", (10, 50, 20, 120)),
         ("Convert {a} degrees Celsius to Fahrenheit and explain the steps.", (-20, 40, 0, 0)),
         ("If I walk {a} steps a day, how many steps is that in {b} days?", (3000, 12000, 7, 30)),
         ("A rectangle is {a} meters long and {b} meters wide. What are its area and perimeter?", (3, 40, 2, 25))]
_STYLE_NOTES = [" Keep it short.", " Please answer in three bullet points.", " Explain it simply.",
                " Give one concrete example.", " Answer in one paragraph.", " Use plain language.",
                " I am a complete beginner.", " Be specific.", " Keep it under 100 words.",
                " Answer like a friendly teacher.", " Give me the short version first.", " Thanks!"]


def _math_asks() -> list[str]:
    rng = random.Random(7)
    asks = []
    for template, (lo, hi, lo2, hi2) in _MATH:
        for _ in range(40):
            a, b = rng.randint(lo, hi), rng.randint(lo2, hi2) if hi2 else 0
            asks.append(template.format(a=a, b=b or rng.randint(2, 9), c=rng.randint(2, 12)))
    return asks


@functools.lru_cache(maxsize=1)
def chat_asks() -> tuple[str, ...]:
    """Every plain chat ask, unique, in a fixed order: the built-in set's chat first."""
    asks = list(CHAT) + EXTRA_CHAT + EVERYDAY_CHAT + python_topic_prompts()
    for items, templates in ((_HOBBIES, _HOBBY_ASKS), (_SCIENCE, _SCIENCE_ASKS), (_HISTORY, _HISTORY_ASKS),
                             (_DISHES, _DISH_ASKS), (_DESTINATIONS, _DESTINATION_ASKS),
                             (_SITUATIONS, _SITUATION_ASKS), (_ANIMALS, _ANIMAL_ASKS), (_SKILLS, _SKILL_ASKS),
                             (_WORDS, _WORD_ASKS)):
        asks += [template.format(item) for item in items for template in templates]
    asks += [template.format(form, subject) for form in _FORMS for subject in _SUBJECTS for template in _WRITE_ASKS]
    asks += [f"Suggest five {thing} for {occasion}." for thing in _THINGS for occasion in _OCCASIONS]
    asks += [template.format(a, b) for a, b in _PAIRS for template in _PAIR_ASKS]
    asks += _math_asks()
    return tuple(dict.fromkeys(ask for ask in asks if not _is_unseen(ask)))


# -- the standard library, parsed ------------------------------------------------------------------

class Found(tuple):
    """(module, qualified name, kind, first docstring paragraph, dedented source or "", recursive,
    local names): one function, method or class of a module, as the pool uses it."""

    module = property(lambda self: self[0])
    name = property(lambda self: self[1])
    kind = property(lambda self: self[2])
    doc = property(lambda self: self[3])
    source = property(lambda self: self[4])
    recursive = property(lambda self: self[5])
    local_names = property(lambda self: self[6])


def _first_paragraph(doc: str | None) -> str:
    text = " ".join((doc or "").strip().split("\n\n")[0].split())
    return text if 15 <= len(text) <= 300 and not text.lower().startswith(("deprecated", "internal")) else ""


def _local_names(node: ast.AST, nodes: list[ast.AST]) -> tuple[str, ...]:
    names = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    return tuple(sorted(n for n in names if len(n) > 1 and n not in ("self", "cls") and not n.startswith("_")))


def _source_of(lines: list[str], node: ast.AST) -> str:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    if not 3 <= node.end_lineno - start + 1 <= 40:
        return ""
    source = textwrap.dedent("".join(lines[start - 1 : node.end_lineno]))
    if len(source) > 1500 or any(len(line) > 110 for line in source.splitlines()):
        return ""
    try:
        ast.parse(source)
    except SyntaxError:  # a multi-line string less indented than the method: dedent cannot help
        return ""
    return source


def _public(name: str) -> bool:
    return not name.startswith("_") or name in ("__init__", "__repr__", "__eq__", "__iter__", "__len__",
                                                   "__contains__", "__getitem__", "__str__", "__hash__")


@functools.lru_cache(maxsize=None)
def stdlib_found() -> tuple[Found, ...]:
    """Public functions, classes and their methods of POOL_MODULES, in module order, each once."""
    found, seen = [], set()
    for module in dict.fromkeys(POOL_MODULES):
        try:
            spec = importlib.util.find_spec(module)
            origin = spec.origin if spec else None
            if not origin or not origin.endswith(".py"):
                continue
            with open(origin, encoding="utf-8") as f:
                text = f.read()
            tree = ast.parse(text)
        except Exception:  # missing from this build of Python, or unreadable: the pool stays offline
            continue
        lines = text.splitlines(keepends=True)
        public_module = module.split("._")[0]  # zoneinfo._zoneinfo -> zoneinfo
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _public(node.name) \
                    and not node.name.startswith("__"):
                items = [(node.name, node)]
                if isinstance(node, ast.ClassDef):
                    items += [(f"{node.name}.{sub.name}", sub) for sub in node.body
                              if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(sub.name)]
                for qualified, item in items:
                    source = _source_of(lines, item)
                    key = source or f"{public_module}.{qualified}"
                    if key in seen:
                        continue
                    seen.add(key)
                    kind = "class" if isinstance(item, ast.ClassDef) else ("method" if "." in qualified
                                                                           else "function")
                    nodes = list(ast.walk(item))
                    recursive = kind != "class" and any(
                        isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", None)) == item.name
                        for c in nodes)
                    found.append(Found((public_module, qualified, kind, _first_paragraph(ast.get_docstring(item)),
                                        source, recursive, _local_names(item, nodes))))
    return tuple(found)


# -- coding -----------------------------------------------------------------------------------------

_FUNCTION_ASKS = [
    "Write a Python function that does this: {doc}",
    "Write a Python function `{short}` that does the following. {doc}",
    "Implement `{short}` in Python with a short example of its use. It should: {doc}",
    "Write a unit test for a function `{short}` that does this: {doc}",
    "Without using the `{module}` module, write a Python function that does this: {doc}",
    "How would I use `{module}.{name}` in Python? Its documentation says: {doc}",
    "Write a small command-line script that uses `{module}.{name}`. The function: {doc}",
    "Write a Python function with type hints and a docstring for this task: {doc}",
    "Explain what `{module}.{name}` does and show an example: {doc}",
    "Write pytest tests covering the edge cases of a function that does this: {doc}",
    "I need a Python helper for this: {doc} Can you write it?",
    "Write `{short}` in Python, then explain how it works step by step. It should: {doc}",
    "Write a Python function for this task and say what its time complexity is: {doc}",
    "Give me a JavaScript and a Python version of a function that does this: {doc}",
]
_CLASS_ASKS = [
    "Write a Python class `{short}`: {doc}",
    "Write a Python class that does this, with a short usage example: {doc}",
    "Explain the `{module}.{name}` class and show how to use it: {doc}",
    "Write a minimal version of `{module}.{name}` from scratch. It is described as: {doc}",
    "Write a unit test for a class `{short}` described like this: {doc}",
    "Design a Python class for this and explain the design: {doc}",
    "What is `{module}.{name}` for, and when would I use it instead of writing my own? It says: {doc}",
    "Write a simplified `{short}` class in Python with type hints. It should match this description: {doc}",
]
_METHOD_ASKS = [
    "Write a Python method `{short}` for a class. It should: {doc}",
    "What does the method `{module}.{name}` do? Its docstring says: {doc}",
    "Implement this as a method of a small Python class, with an example: {doc}",
    "Write a unit test for a method `{short}` that does this: {doc}",
    "Write a Python class with a method `{short}` that does this: {doc}",
    "When would I call `{name}` from the `{module}` module? Its docstring says: {doc}",
    "Show a short example that calls `{module}.{name}`, which does this: {doc}",
    "Write a standalone Python function that does what the method `{short}` does: {doc}",
]

_STRUCTURES = ["a singly linked list", "a doubly linked list", "a binary search tree", "a queue built on two stacks",
               "a min-heap", "a max-heap", "a trie", "a circular buffer", "an LRU cache",
               "a graph as an adjacency list",
               "a priority queue", "a double-ended queue", "a hash map with separate chaining", "a sparse matrix",
               "a set of non-overlapping intervals", "a bit set", "a disjoint-set (union-find)", "a counter of words",
               "a bounded queue", "a matrix class", "a directed acyclic graph", "a sorted list", "a ring of players",
               "an inventory of library books", "a to-do list", "a bank account", "a deck of cards",
               "a shopping cart", "a phone book", "a timer"]
_OPERATIONS = [("adding an item", "removing an item"), ("checking whether it holds a value", "returning its size"),
               ("iterating over its items", "clearing it"), ("converting it to a list", "a readable __repr__"),
               ("saving it to a JSON file", "loading it back"), ("merging it with another one", "copying it"),
               ("finding the smallest item", "finding the largest item"), ("undoing the last change", "printing it")]
_STRUCTURE_ASKS = ["Write a Python class for {} that supports {} and {}.",
                   "Implement {} in Python with {} and {}, and show a short example.",
                   "Write {} in Python, supporting {} and {}, with unit tests."]
_STRING_TASKS = ["reverses the words of a sentence", "checks whether a string is a palindrome",
                 "capitalizes the first letter of every word", "removes duplicate characters from a string",
                 "finds the longest word in a sentence", "counts how often each word appears in a text",
                 "converts a string from snake_case to camelCase", "converts a string from camelCase to snake_case",
                 "checks whether two strings are anagrams", "compresses a string like 'aaabb' into 'a3b2'",
                 "wraps a long line of text at 40 characters", "strips punctuation from a string",
                 "finds every email address in a text", "turns a title into a URL slug",
                 "checks whether brackets in a string are balanced", "counts the consonants in a word",
                 "returns the most common letter in a string", "masks all but the last four digits of a card number",
                 "pads a number with leading zeros to eight digits", "splits a CSV line that may hold quoted commas",
                 "finds the first character that does not repeat", "rotates a string by n places",
                 "checks whether a string is a valid IPv4 address", "truncates a string to n characters with '...'",
                 "converts a Roman numeral to an integer", "converts an integer to a Roman numeral",
                 "encodes a string with a Caesar cipher", "removes extra spaces between words",
                 "counts the sentences in a paragraph", "formats a number with thousands separators"]
_LIST_TASKS = ["returns the second largest number in a list", "removes duplicates from a list keeping the order",
               "flattens a nested list", "splits a list into chunks of size n", "rotates a list by k positions",
               "finds the pairs in a list that add up to a target", "returns the running total of a list",
               "groups words by their first letter", "finds the missing number in a list from 1 to n",
               "returns the intersection of two lists", "moves all zeros of a list to the end",
               "finds the longest increasing run in a list", "transposes a matrix given as a list of lists",
               "computes the median of a list of numbers", "counts the even and odd numbers in a list",
               "returns the n largest items of a list", "zips two lists into a dictionary",
               "inverts a dictionary", "sorts a list of dictionaries by a key", "finds the mode of a list",
               "checks whether a list is sorted", "computes a moving average over a list",
               "returns the prime numbers below n", "computes the greatest common divisor of two numbers",
               "returns the first n Fibonacci numbers", "checks whether a number is a power of two",
               "converts a decimal number to binary", "computes the factorial of a number",
               "sums the digits of a number", "checks whether a year is a leap year"]
_FILE_TASKS = ["counts the lines, words and characters of a text file", "finds the largest files in a folder",
               "renames every .txt file in a folder to lowercase",
               "reads a CSV file and prints the average of a column",
               "merges several text files into one", "finds duplicate files in a folder by their hash",
               "prints the last ten lines of a log file", "converts a JSON file to CSV",
               "backs up a folder into a dated zip file", "deletes files older than thirty days in a folder",
               "searches every .py file in a folder for a word", "reads a config file and prints its sections",
               "lists the files of a folder sorted by modification time", "splits a big text file into parts",
               "counts the error lines in a log file", "copies only the images from one folder to another",
               "prints a tree of a folder's contents", "replaces a word in every file of a folder",
               "checks which lines two text files have in common", "writes a list of dictionaries to a CSV file"]
_TASK_ASKS = ["Write a Python function that {}.", "Write a Python script that {}.",
              "Show two ways to write a Python function that {}.",
              "Write a Python function with type hints and a docstring that {}.",
              "Write a Python function that {}, and a few tests for it."]


def _structure_asks() -> list[str]:
    return [ask.format(structure, a, b) for structure in _STRUCTURES for a, b in _OPERATIONS for ask in _STRUCTURE_ASKS]


@functools.lru_cache(maxsize=1)
def _coding_bases() -> tuple[tuple[str, ...], ...]:
    """Each base item's asks (one per ask shape): the docstring items, then the generic tasks."""
    bases = []
    for item in stdlib_found():
        if not item.doc:
            continue
        short = item.name.split(".")[-1]
        asks = {"class": _CLASS_ASKS, "method": _METHOD_ASKS}.get(item.kind, _FUNCTION_ASKS)
        bases.append(tuple(ask.format(doc=item.doc, short=short, module=item.module, name=item.name) for ask in asks))
    for task in _STRING_TASKS + _LIST_TASKS + _FILE_TASKS:
        bases.append(tuple(ask.format(task) for ask in _TASK_ASKS))
    structures = _structure_asks()
    bases += [tuple(structures[i : i + len(_STRUCTURE_ASKS)]) for i in range(0, len(structures), len(_STRUCTURE_ASKS))]
    return tuple(tuple(ask for ask in asks if not _is_unseen(ask)) for asks in bases)


# -- code editing -----------------------------------------------------------------------------------

_CLASS_NAMES = ["TextTools", "Helper", "Processor", "Toolkit", "Converter", "Utility", "Service", "Worker", "Parser",
                "Formatter", "Manager", "Runner"]
_NEW_NAMES = ["result", "value", "items", "current", "total", "count", "output", "entry", "data", "parts", "text",
              "index"]


def _edit_instructions(item: Found) -> list[str]:
    """The edits that make sense for this source; any needing a name picks one from the source."""
    what = "class" if item.kind == "class" else "function"
    rng = random.Random(item.name + item.source[:40])
    edits = [f"Add type hints to this {what} and show the complete {what}.",
             f"Add a docstring to this {what} and print it again in full.",
             f"Rewrite this {what} with clearer names and print it again.",
             f"Add logging to this {what} using the logging module and show the result.",
             f"Simplify this {what} and show the result.",
             f"Add comments explaining each step of this {what}.",
             f"Write pytest tests for this {what}.",
             "Explain this code line by line.",
             f"Fix any bug you see in this {what} and show the corrected version.",
             f"Add error handling for invalid arguments to this {what} and show the complete {what}.",
             f"Review this {what}: what could go wrong, and how would you improve it?",
             "What does this code do? Answer in two or three sentences."]
    if item.local_names:
        old = rng.choice(item.local_names)
        new = rng.choice([n for n in _NEW_NAMES if n not in item.local_names and n != old] or ["renamed"])
        edits.append(f"Rename the variable `{old}` to `{new}` and show the whole {what} again.")
        edits.append(f"Rename `{old}` to a more descriptive name everywhere in this {what}.")
    if item.kind == "function":
        edits.append(f"Convert this function into a method of a class named `{rng.choice(_CLASS_NAMES)}`.")
    if item.kind == "class":
        edits.append("Add a __repr__ method to this class and show the complete class.")
    if item.recursive:
        edits.append("Make this function iterative instead of recursive.")
    if "for " in item.source and ".append(" in item.source:
        edits.append(f"Rewrite the loops that build lists in this {what} as list comprehensions where it helps.")
    if "open(" in item.source:
        edits.append(f"Make sure every file this {what} opens is closed, using `with`, and show the result.")
    return edits


@functools.lru_cache(maxsize=1)
def _editing_bases() -> tuple[tuple[Found, tuple[str, ...]], ...]:
    return tuple((item, tuple(_edit_instructions(item))) for item in stdlib_found() if item.source)


def _editing_message(item: Found, instruction: str, fenced: bool) -> list[dict]:
    code = f"```python\n{item.source}```" if fenced else item.source
    return [{"role": "user", "content": f"{instruction}\n\n{code}"}]


# -- tool use -------------------------------------------------------------------------------------

def _spec(tool_name: str, description: str, /, **params: str) -> ToolSpec:
    required = [key.rstrip("_") for key in params if not key.endswith("_")]
    properties = {key.rstrip("_"): {"type": "string", "description": text} for key, text in params.items()}
    return ToolSpec(tool_name, description, {"type": "object", "properties": properties, "required": required})


# Each set: its tools, then which tool (and argument) reads, lists, runs and searches; None where the set cannot.
_TOOL_SETS = [
    ([_spec("read_file", "Read a file of the project.", path="Path relative to the project root."),
      _spec("write_file", "Write a file, replacing its content.", path="Path of the file.", content="New content."),
      _spec("run_command", "Run a shell command and return its output.", command="The command line.")],
     {"read": ("read_file", "path"), "run": ("run_command", "command"), "list": ("run_command", "command"),
      "search": ("run_command", "command")}),
    ([_spec("read_file", "Return the text of a file.", path="File path.", start_line_="First line to read."),
      _spec("list_dir", "List the entries of a directory.", path="Directory path."),
      _spec("apply_patch", "Apply a unified diff to the working tree.", patch="The diff."),
      _spec("shell", "Execute a shell command in the repository.", command="Command to run.")],
     {"read": ("read_file", "path"), "list": ("list_dir", "path"), "run": ("shell", "command"),
      "search": ("shell", "command")}),
    ([_spec("open_file", "Open a source file and show its content.", path="The file to open."),
      _spec("search_code", "Search the code base for a pattern.", query="Text or regex to find.",
            path_="Folder to search in."),
      _spec("run_tests", "Run the project's test suite.", target_="A test file or folder.")],
     {"read": ("open_file", "path"), "search": ("search_code", "query"), "run": ("run_tests", "target"),
      "list": None}),
    ([_spec("cat", "Print a file.", path="File to print."),
      _spec("ls", "List a directory.", path="Directory."),
      _spec("grep", "Find lines matching a pattern.", pattern="Regular expression.", path="Where to search."),
      _spec("bash", "Run a bash command.", script="The command.")],
     {"read": ("cat", "path"), "list": ("ls", "path"), "search": ("grep", "pattern"), "run": ("bash", "script")}),
    ([_spec("view", "View a file with line numbers.", file="The file."),
      _spec("edit", "Replace text in a file.", file="The file.", old="Text to replace.", new="Replacement."),
      _spec("find", "Find files or definitions by name.", name="What to find."),
      _spec("execute", "Execute a command in a sandbox.", command="The command.", timeout_="Seconds to wait.")],
     {"read": ("view", "file"), "search": ("find", "name"), "run": ("execute", "command"),
      "list": ("execute", "command")}),
]
_FOLDERS = ["", "src/", "app/", "lib/", "utils/", "src/core/", "pkg/", "tools/"]
_READ_ASKS = [
    "Fix the bug in `{short}` in {path}: it crashes on empty input.",
    "Add type hints to `{short}` in {path}.",
    "Explain what `{short}` in {path} does.",
    "Write tests for `{short}` in {path}.",
    "Add a docstring to `{short}` in {path}.",
    "Rename `{bare}` to `{bare}_safe` in {path} and update the file.",
    "Make `{short}` in {path} handle None arguments gracefully.",
    "Add logging to `{short}` in {path}.",
    "Refactor `{short}` in {path} so it is easier to read.",
    "Is there anything wrong with `{short}` in {path}? Check and tell me.",
    "Add an optional `verbose` flag to `{short}` in {path}.",
    "Speed up `{short}` in {path} if you can.",
    "Document the parameters of `{short}` in {path}.",
    "Review {path}, especially `{short}`, and suggest improvements.",
    "Can you look at `{short}` in {path} and add input validation?",
]
_SEARCH_ASKS = ["Find where `{short}` is defined.", "Where is `{short}` implemented in this project?",
                "Which file defines `{short}`? Then explain it.", "Look up `{short}` and tell me what it returns."]
_LIST_ASKS = ["What is in this repository? Summarize its layout.", "Which files hold the tests here?",
              "Show me the project structure and tell me where to start reading.",
              "List the files in the project and guess what it does.", "Where is the entry point of this project?"]
_RUN_ASKS = ["Run the tests and tell me what fails.", "Run the test suite for {path}.",
             "Check whether the tests pass after my change to `{short}`.", "Run the tests and fix any failure."]


def _tool_path(item: Found, rng: random.Random) -> str:
    stem = item.module.split(".")[-1].lstrip("_")
    return rng.choice(_FOLDERS) + rng.choice([stem, f"{stem}_utils", f"{stem}_helpers", stem]) + ".py"


def _call(tool: tuple[str, str], value: str) -> dict:
    name, argument = tool
    return {"role": "assistant", "content": builtin_call_text(ToolCall(id="", name=name,
                                                                       arguments=json.dumps({argument: value})))}


def _file_text(item: Found) -> str:
    """A read file's content: the source, a method inside its class as the file has it."""
    if item.kind != "method":
        return item.source
    return f"class {item.name.split('.')[0]}:\n" + textwrap.indent(item.source, "    ", lambda line: bool(line.strip()))


def _result(content: str) -> dict:
    return {"role": "user", "content": f"<tool_response>\n{content}</tool_response>"}


def _listing(items: list[Found], rng: random.Random) -> str:
    stems = sorted({i.module.split(".")[-1].lstrip("_") for i in items})
    root = rng.choice(["src/", "app/", "lib/", ""])
    files = ["README.md", "pyproject.toml", rng.choice([".gitignore", "setup.cfg", "Makefile", "LICENSE"])]
    files += [f"{root}{s}.py" for s in stems] + [f"tests/test_{s}.py" for s in stems[: rng.randint(1, len(stems))]]
    return "\n".join(sorted(files)) + "\n"


def _test_output(item: Found, rng: random.Random, path: str) -> str:
    short = item.name.split(".")[-1].strip("_")
    passed, failed = rng.randint(3, 80), rng.choice([0, 0, 1, 2])
    test_file = "tests/test_" + path.rsplit("/", 1)[-1]
    if not failed:
        return f"{'.' * min(passed, 40)}\n{passed} passed in {rng.randint(1, 90) / 10:.1f}s\n"
    lines = [line.strip() for line in item.source.splitlines() if line.strip()]
    lines = lines or [f"assert {short}(value) == expected"]
    first = rng.choice(lines)
    error = rng.choice(["TypeError: 'NoneType' object is not subscriptable", "AssertionError", "KeyError: 'name'",
                        "ValueError: invalid literal for int() with base 10: ''",
                        "IndexError: list index out of range"])
    return (f"{'.' * min(passed, 30)}F\nFAILED {test_file}::test_{short}_handles_edge_case - {error}\n"
            f"    {first}\nE   {error}\n{failed} failed, {passed} passed in {rng.randint(1, 90) / 10:.1f}s\n")


def _tool_conversation(item: Found, others: list[Found], ask_index: int, set_index: int,
                       rng: random.Random) -> list[dict]:
    tools, roles = _TOOL_SETS[set_index]
    path = _tool_path(item, rng)
    short = item.name.split(".")[-1]
    if item.kind == "method":
        short = item.name  # Class.method
    flows = (["read"] * 3 + ["search"] * 2 + ["run", "list"] if item.source else ["search", "run", "list"])
    flow = [f for f in flows if roles.get(f)][ask_index % len([f for f in flows if roles.get(f)])]
    asks = {"read": _READ_ASKS, "search": _SEARCH_ASKS, "list": _LIST_ASKS, "run": _RUN_ASKS}[flow]
    ask = asks[(ask_index // 7) % len(asks)]
    if "{bare}" in ask and short.split(".")[-1].startswith("__"):  # no renaming a dunder
        ask = asks[0]
    ask = ask.format(short=short, bare=short.split(".")[-1], path=path)
    messages = [{"role": "system", "content": builtin_tool_prompt(tools)}, {"role": "user", "content": ask}]
    if rng.random() < 0.25:
        return messages  # the first turn: the model should call a tool
    tool = roles[flow]
    if flow == "read":
        messages += [_call(tool, path), _result(_file_text(item))]
    elif flow == "search":
        bare, keyword = short.split(".")[-1], "class" if item.kind == "class" else "def"
        query = f"grep -rn '{keyword} {bare}' ." if tool[1] in ("command", "script") else \
            (f"{keyword} {bare}" if tool[1] in ("pattern", "query") else short)
        heads = [line for line in item.source.splitlines()
                 if line.lstrip().startswith(("def ", "async def ", "class "))]
        first = heads[0] if heads else f"{keyword} {bare}" + (":" if keyword == "class" else "(...):")
        hits = f"{path}:{rng.randint(5, 400)}:{'    ' if item.kind == 'method' else ''}{first.strip()}\n"
        use = f"obj.{bare}(value)" if item.kind == "method" else f"result = {bare}(value)"
        for other in rng.sample(others, min(2, len(others))):
            hits += f"{_tool_path(other, rng)}:{rng.randint(5, 400)}:    {use}\n"
        messages += [_call(tool, query), _result(hits)]
        if item.source and roles.get("read") and rng.random() < 0.5:
            messages += [_call(roles["read"], path), _result(_file_text(item))]
    elif flow == "list":
        command = "ls -R" if tool[1] in ("command", "script") else "."
        messages += [_call(tool, command), _result(_listing([item] + others, rng))]
    else:
        test_file = f"tests/test_{path.rsplit('/', 1)[-1]}"
        command = rng.choice(["python -m pytest -q", "pytest -x", "make test", f"pytest {test_file}"])
        value = command if tool[1] in ("command", "script") else test_file
        messages += [_call(tool, value), _result(_test_output(item, rng, path))]
    return messages


@functools.lru_cache(maxsize=1)
def _tool_items() -> tuple[Found, ...]:
    return tuple(item for item in stdlib_found() if item.source or item.doc)


# -- the pool ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _unseen() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(unseen user texts, unseen code): no pool conversation may contain any of them."""
    from dflash.training import unseen

    texts = {m["content"] for conversations in unseen.UNSEEN_PROMPTS.values() for messages in conversations
             for m in messages if m["role"] == "user" and not m["content"].startswith("<tool_response>")}
    return tuple(sorted(texts)), (unseen._INVENTORY, unseen._PARSER)


def _is_unseen(text: str) -> bool:
    texts, code = _unseen()
    return any(t in text for t in texts) or any(c in text for c in code)


def _kind_stream(kind: str, seed: int) -> Iterator[list[dict]]:
    """One kind's conversations, endlessly: each round takes every base item once in a new order,
    with the next of its variants (ask shape, instruction, style note, tool set) each round, so
    repeats come only after every variant of every item."""
    rng = random.Random(f"{seed}:{kind}")
    if kind == "chat":
        asks = list(chat_asks())
        notes = [""] + _STYLE_NOTES
        for round_ in range(1 << 30):
            order = asks[:]
            rng.shuffle(order)
            for ask in order:
                yield [{"role": "user", "content": ask + notes[round_ % len(notes)]}]
    build: Callable[[int, int], list[dict]]
    if kind == "coding":
        bases = _coding_bases()
        build = lambda i, r: [{"role": "user", "content": bases[i][r % len(bases[i])]}]  # noqa: E731
    elif kind == "code editing":
        editing = _editing_bases()
        build = lambda i, r: _editing_message(editing[i][0], editing[i][1][r % len(editing[i][1])],  # noqa: E731
                                              (r // len(editing[i][1]) + i) % 3 == 0)
        bases = editing
    elif kind == "tool use":
        items = _tool_items()
        bases = items

        def build(i: int, r: int) -> list[dict]:
            local = random.Random(f"{seed}:{i}:{r}")
            others = [items[local.randrange(len(items))] for _ in range(local.randint(2, 6))]
            return _tool_conversation(items[i], others, r, (r + i) % len(_TOOL_SETS), local)
    else:
        raise ValueError(f"unknown prompt kind {kind!r}: kinds are {KINDS}")
    offsets = [rng.randrange(64) for _ in bases]  # each item starts at another variant
    for round_ in range(1 << 30):
        order = list(range(len(bases)))
        rng.shuffle(order)
        for i in order:
            yield build(i, offsets[i] + round_)


def _fits(messages: list[dict]) -> bool:
    """Short enough for the prompt budget (the tool prompt alone is ~1.3K characters), and none of
    the unseen prompts."""
    text = "".join(m["content"] for m in messages)
    return len(text) <= MAX_CHARS and not _is_unseen(text)


def scaled_conversations(count: int, seed: int = 0, shares: dict[str, float] | None = None
                         ) -> list[tuple[str, list[dict]]]:
    """`count` (kind, messages) pairs, the same for a seed, interleaved so that every prefix holds the
    kinds in about the `shares` (default `DEFAULT_SHARES`). Within a kind nothing repeats until its
    variants run out (see the module docstring for the supply)."""
    shares = dict(DEFAULT_SHARES if shares is None else shares)
    if not shares or set(shares) - set(KINDS) or any(share <= 0 for share in shares.values()):
        raise ValueError(f"prompt pool shares {shares!r}: kinds are {KINDS} with positive shares")
    rng = random.Random(seed)
    streams = {kind: _kind_stream(kind, seed) for kind in shares}
    emitted = {kind: 0 for kind in shares}
    seen: set[str] = set()
    pool = []
    while len(pool) < count:
        kind = min(shares, key=lambda k: ((emitted[k] + rng.random()) / shares[k], k))
        chosen = None
        for _ in range(20):  # past the supply, a repeat is taken rather than looping forever
            messages = next(streams[kind])
            if not _fits(messages):
                continue
            key = json.dumps(messages)
            if chosen is None or key not in seen:
                chosen = messages, key
            if key not in seen:
                break
        if chosen is None:
            raise RuntimeError(f"no {kind} conversation fits the prompt budget")
        messages, key = chosen
        seen.add(key)
        emitted[kind] += 1
        pool.append((kind, messages))
    return pool
