"""The default prompt set for `dflash train-drafter`, built offline from text that ships with Python:
chat questions about the standard library, coding tasks from its docstrings, code-editing turns
over its own small functions, and tool-use style turns; then (`EXTRA_CHAT` and more modules) everyday
chat and more of the same, appended after the first set so that a prompt's index, which names its
reply shard, stays the same when the count grows; past the first 1100 (the most any drafter before
this tier saw), the rest of those mixed with `EVERYDAY_CHAT`, chat in many more shapes."""

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


# The third tier (after the first 1100 prompts, mixed with the rest of the second): everyday chat
# in many shapes, since chat is where the drafter was weakest (τ 1.1 on the unseen chat prompts, with 92
# chat prompts of 1100). Written for this list; none is an unseen prompt.
_ACTIVITIES = ["baking sourdough bread", "camping in the rain", "learning the guitar", "painting with watercolors",
               "birdwatching", "growing tomatoes on a balcony", "knitting a scarf", "swimming laps", "rock climbing",
               "writing a journal", "playing chess", "hiking in the mountains", "brewing coffee at home",
               "cycling to work", "doing yoga at home", "learning to juggle", "building a birdhouse",
               "baking cookies with kids", "training a puppy", "keeping a fish tank", "organizing a closet",
               "planning a birthday party", "moving to a new apartment", "hosting a dinner party", "ice skating",
               "learning to swim as an adult", "making pottery", "writing poetry", "photographing the night sky",
               "playing the piano", "learning to sew", "fixing a leaky faucet", "painting a room",
               "decorating a small bedroom", "shopping for groceries on a budget", "meal prepping for the week",
               "packing for a long flight", "visiting a museum", "running a marathon", "learning to skateboard",
               "planting a tree", "making homemade pasta", "fishing in a lake", "kayaking", "playing tennis",
               "caring for an elderly parent", "volunteering at a food bank", "writing a novel",
               "learning sign language", "teaching a child to ride a bike"]
_ACTIVITY_ASKS = ["Give me some tips for {}.", "What should a beginner know about {}?",
                  "What are common mistakes people make when {}?"]
_CONCEPTS = ["gravity", "electricity", "magnetism", "evolution", "the immune system", "climate change", "erosion",
             "volcanoes", "earthquakes", "rainbows", "the seasons", "the moon's phases", "friction", "sound waves",
             "static electricity", "fermentation", "digestion", "sleep cycles", "muscle growth", "the placebo effect",
             "memory", "habits", "taxes", "interest rates", "a budget", "insurance", "a mortgage", "democracy",
             "the stock market", "recycling", "renewable energy", "nuclear power", "antibiotics", "allergies",
             "the speed of light", "time zones", "leap years", "the internet", "email", "a password manager",
             "batteries", "microwaves", "rain", "snowflakes", "the northern lights", "coral reefs", "bees",
             "migration of birds", "the food chain", "composting"]
_CONCEPT_ASKS = ["Explain {} in simple terms.", "Why is {} important?", "What is a common misconception about {}?"]
_FIGURES = ["Abraham Lincoln", "Frida Kahlo", "Mahatma Gandhi", "Amelia Earhart", "Ludwig van Beethoven",
            "Rosalind Franklin", "Julius Caesar", "Florence Nightingale", "Nikola Tesla", "Harriet Tubman",
            "Wolfgang Amadeus Mozart", "Martin Luther King Jr.", "Katherine Johnson", "Genghis Khan",
            "William Shakespeare", "Queen Victoria", "Louis Pasteur", "Confucius", "Vincent van Gogh", "Rachel Carson",
            "Napoleon Bonaparte", "Sally Ride", "Johannes Gutenberg", "Pablo Picasso", "Thomas Edison",
            "Emmeline Pankhurst", "Srinivasa Ramanujan", "Joan of Arc", "Benjamin Franklin", "Hypatia"]
_FIGURE_ASKS = ["Tell me about {} in a few sentences.", "What can we learn from the life of {}?"]
_PLACES = ["Iceland", "Kyoto", "the Sahara desert", "the Amazon rainforest", "Venice", "New Zealand", "Peru",
           "Morocco", "the Grand Canyon", "Norway's fjords", "Istanbul", "Cape Town", "Vietnam", "the Scottish Highlands",
           "Patagonia", "Prague", "the Great Barrier Reef", "Mexico City", "Lisbon", "the Swiss Alps", "Cairo",
           "Vancouver", "Bali", "Edinburgh", "Buenos Aires"]
_PLACE_ASKS = ["What should I see on a first visit to {}?", "Describe {} to someone who has never been there."]
_FOODS = ["risotto", "pancakes", "a vegetable curry", "guacamole", "banana bread", "a simple omelette", "hummus",
          "tomato soup", "fried rice", "lemonade", "a Greek salad", "chili", "roasted vegetables", "apple pie",
          "scrambled tofu", "miso soup", "granola", "a stir-fry", "mashed potatoes", "pizza dough"]
_FOOD_ASKS = ["How do I make {}?", "What goes well with {}?"]
_PAIRS = [("a cold", "the flu"), ("a rabbit", "a hare"), ("a lake", "a pond"), ("a blizzard", "a snowstorm"),
          ("a democracy", "a republic"), ("a debit card", "a credit card"), ("an emu", "an ostrich"),
          ("a psychologist", "a psychiatrist"), ("sunscreen", "sunblock"), ("a bay", "a gulf"), ("a poem", "a song"),
          ("espresso", "drip coffee"), ("a novel", "a novella"), ("a wolf", "a coyote"), ("a mountain", "a hill"),
          ("a mushroom", "a toadstool"), ("an ape", "a monkey"), ("a tortoise", "a turtle"), ("a duvet", "a comforter"),
          ("a loan", "a grant"), ("a cyclone", "a typhoon"), ("a star", "a planet"), ("a fruit", "a vegetable"),
          ("a job", "a career"), ("a skill", "a talent"), ("a habit", "a routine"), ("a lawyer", "an attorney"),
          ("a thesis", "a dissertation"), ("a cello", "a double bass"), ("a canoe", "a kayak")]
_WRITING = [("a short poem", "the first snow of winter"), ("a short story", "a dragon who is afraid of the dark"),
            ("a haiku", "morning coffee"), ("a toast", "my best friend's wedding"), ("a short story", "a time traveler at a farmers market"),
            ("a limerick", "a cat who loves to sleep"), ("a letter", "my future self"), ("a short poem", "a city at dawn"),
            ("a motivational message", "a friend starting a new job"), ("a short story", "two strangers stuck in an elevator"),
            ("a product description", "a handmade wooden chair"), ("a short poem", "a summer thunderstorm"),
            ("an invitation", "a neighborhood picnic"), ("a short fable", "a fox and a crow"),
            ("a short story", "a lighthouse keeper's last night"), ("a riddle", "a clock"),
            ("a short speech", "the value of kindness"), ("a get-well note", "a coworker"),
            ("a short poem", "an old oak tree"), ("a bedtime story", "a sleepy bear")]
_DECISIONS = ["buying a used car", "choosing a college major", "adopting a cat", "starting a small business",
              "switching careers at forty", "renting a place with a friend", "buying an electric bike",
              "learning a second language", "moving to the countryside", "taking a gap year", "getting a dog",
              "buying a house", "changing jobs", "going back to school", "planning a wedding"]
_DECISION_ASKS = ["What should I consider before {}?", "What are the pros and cons of {}?"]
_ODD_QUESTIONS = ["Why do cats purr?", "Why do we yawn?", "Why is the ocean salty?", "Why do onions make us cry?",
                  "Why do leaves fall in autumn?", "Why do we dream?", "How do bees make honey?",
                  "How do birds know where to fly in winter?", "Why do we get goosebumps?", "Why is ice slippery?",
                  "How do chameleons change color?", "Why do stars twinkle?", "Why do our ears pop on airplanes?",
                  "How does a compass work?", "Why does bread go stale?", "How do whales communicate?",
                  "Why do some people snore?", "How do plants know which way is up?", "Why is yawning contagious?",
                  "Why do dogs wag their tails?"]
EVERYDAY_CHAT = ([ask.format(a) for a in _ACTIVITIES for ask in _ACTIVITY_ASKS]
                 + [ask.format(c) for c in _CONCEPTS for ask in _CONCEPT_ASKS]
                 + [ask.format(f) for f in _FIGURES for ask in _FIGURE_ASKS]
                 + [ask.format(p) for p in _PLACES for ask in _PLACE_ASKS]
                 + [ask.format(f) for f in _FOODS for ask in _FOOD_ASKS]
                 + [f"What is the difference between {a} and {b}?" for a, b in _PAIRS]
                 + [f"Write {form} about {subject}." for form, subject in _WRITING]
                 + [ask.format(d) for d in _DECISIONS for ask in _DECISION_ASKS]
                 + _ODD_QUESTIONS)


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


FIRST_TWO_TIERS = 1100  # the runs made before the third tier keep their prompts at their indices


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
    second = prompts + extra
    if limit <= FIRST_TWO_TIERS:
        return second[:limit]
    # Prompts past the ones the shipped drafters were trained on mix the rest of the second tier with
    # the everyday chat, so a run that takes some of them gets both kinds.
    rest = second[FIRST_TWO_TIERS:] + EVERYDAY_CHAT
    rng.shuffle(rest)
    return (second[:FIRST_TWO_TIERS] + rest)[:limit]
