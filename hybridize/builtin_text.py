"""Text every Python installation carries, so the demo trains and evaluates offline with no data folder.

- Training text: the docstrings of the standard library's modules and of their public classes and
  functions (English prose about programming, ~0.4 MB on CPython 3.11), read with `inspect` from the
  interpreter that runs us.
- More training text, `python-source`: the standard library's own Python source files (code, comments and
  docstrings; ~8 MB on CPython 3.11, of which 2 MB by default and another share as `python-source:4M`, whole
  files in a fixed hash order so the share spreads over the library rather than its first letters), read from the
  interpreter's stdlib folder.
- Held-out text: `pydoc_data.topics`, the Python Language Reference sections that `help()` shows
  (~0.47 MB, 79 topics). It is never in a training mix: both training texts skip `pydoc_data`, and any
  docstring or source file that shares a line of 60+ characters with a topic is dropped (`_without_overlap`).
- Chat prompts: short instructions written for this project (`CHAT_PROMPTS`); the teacher answers them
  (`hybridize demo`), so the student also sees chat-formatted text and keeps answering chat prompts.
  `HELDOUT_CHAT_PROMPTS` are only ever asked, never trained on (`eval recovery`'s chat rows; the demo's first three).

Both texts are licensed with CPython (PSF License); nothing is copied into this repository. They
depend on the Python version, so the demo's numbers are stated with it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import io
import sys
import sysconfig
import warnings
from pathlib import Path

from hybridize.errors import UserError

#: modules never imported: side effects on import (a browser, a window, printing), test suites, and the
#: held-out source itself
SKIP_MODULES = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test",
                          "pydoc_data", "ensurepip", "venv", "lib2to3", "__hello__", "__phello__"})

CHAT_PROMPTS = (
    "Explain how a rainbow forms.",
    "Give three tips for learning to cook at home.",
    "What does a compiler do?",
    "Write a short poem about the sea.",
    "Why do leaves change colour in autumn?",
    "Describe a typical day of a baker.",
    "How do bees make honey?",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting a colleague to lunch.",
    "Explain what a prime number is, with examples.",
    "How does a bicycle stay upright?",
    "Give me a recipe for a simple tomato soup.",
    "What are the main parts of a plant cell?",
    "Summarise the water cycle in a few sentences.",
    "Why is exercise good for health?",
    "Explain recursion to a beginner programmer.",
    "What should I pack for a weekend hiking trip?",
    "Describe how a library organises its books.",
    "Write a short story about a lost umbrella.",
    "How do airplanes fly?",
    "What is photosynthesis?",
    "Give advice for a first job interview.",
    "Explain the rules of tic-tac-toe.",
    "Why do we have seasons on Earth?",
    "What is a good way to learn a new language?",
    "Describe the taste of a lemon to someone who never had one.",
    "How does a refrigerator keep food cold?",
    "Write a thank-you note to a teacher.",
    "What is the difference between a list and a tuple in Python?",
    "Explain what an algorithm is.",
    "How do volcanoes erupt?",
    "Suggest three names for a small coffee shop and explain them.",
    "What happens when water boils?",
    "Explain why the sky is blue.",
    "How can I save money on groceries?",
    "Describe the life cycle of a butterfly.",
    "What is gravity?",
    "Write a short dialogue between a cat and a dog.",
    "How do vaccines work, in simple terms?",
    "Explain what a database is used for.",
    "What are some ways to reduce stress?",
    "Describe a walk through a forest in the morning.",
    "How does the internet send a message from one computer to another?",
    "What is the purpose of a museum?",
    "Explain how to make a paper airplane.",
    "Why do cats purr?",
    "Give a short history of the bicycle.",
    "What makes a good friend?",
)

#: asked of teacher and student after training, never trained on: `hybridize eval recovery`'s chat rows score all
#: of them (64, so that one row counts ~1,000 predictions, not the ~100 of the demo's three), the demo shows the first
#: three (`DEMO_CHAT_PROMPTS`)
HELDOUT_CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three fruits that are yellow.",
    "How many days are in a week?",
    "What is the tallest animal on land?",
    "Why do ships float?",
    "Name two planets that are closer to the Sun than Earth.",
    "What is a haiku?",
    "How do I boil an egg?",
    "What does a thermometer measure?",
    "Explain what a verb is.",
    "Why do we need sleep?",
    "What is the largest ocean?",
    "Give two reasons to drink water.",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
    "What is a noun? Give an example.",
    "Describe a rainy afternoon in two sentences.",
    "What is the freezing point of water in Celsius?",
    "Name three colours of the rainbow.",
    "Why do birds migrate?",
    "What does a pilot do?",
    "How do you say hello in Spanish?",
    "What is a triangle?",
    "Write one sentence about the moon.",
    "What is the main ingredient of bread?",
    "Explain what a map is for.",
    "What are clouds made of?",
    "Name a musical instrument with strings.",
    "How can I keep a plant healthy?",
    "What does a firefighter do?",
    "What is the difference between a lake and a river?",
    "Why is the ocean salty?",
    "What is a keyboard used for?",
    "Tell me a fun fact about elephants.",
    "How many minutes are in an hour?",
    "What is an island?",
    "Suggest a name for a pet goldfish.",
    "What do bees need to survive?",
    "What is electricity used for at home?",
    "Explain what a shadow is.",
    "What is the biggest planet in the solar system?",
    "How do I wash my hands properly?",
    "What is a desert?",
    "Name three animals that live on a farm.",
    "What does a doctor use a stethoscope for?",
    "Write a short greeting for a birthday card.",
    "What is the sun?",
    "How does a clock tell time?",
    "What is a mountain?",
    "Give an example of a healthy breakfast.",
    "What is the job of the heart?",
    "Why do we brush our teeth?",
    "What is a calendar?",
    "How many continents are there?",
    "What does a bridge do?",
    "Describe the colour green to a child.",
    "What is a computer mouse?",
    "What is the difference between a town and a city?",
    "Why do some animals sleep in winter?",
    "What is a recipe?",
    "Name two sports played with a ball.",
    "What makes wind?",
    "How should I store fresh bread?",
    "What is a telescope used for?",
)

#: what `hybridize demo` asks teacher and student at its end
DEMO_CHAT_PROMPTS = HELDOUT_CHAT_PROMPTS[:3]


def _quiet_import(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # a module that needs a missing system library, or exits: skip it
            return None


def _docs_of(module) -> list[str]:
    """The module's docstring and those of the public classes / functions it defines."""
    with warnings.catch_warnings():   # reading a deprecated module's members warns
        warnings.simplefilter("ignore")
        return _docstrings(module)


def _docstrings(module) -> list[str]:
    objs = [module] + [v for k, v in sorted(vars(module).items())
                       if not k.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))
                       and getattr(v, "__module__", None) == module.__name__]
    docs = []
    for obj in objs:
        doc = obj.__doc__ if obj is module else inspect.getdoc(obj)
        if isinstance(doc, str):
            docs.append(inspect.cleandoc(doc))
    return docs


def language_reference_topics() -> list[str]:
    """The held-out text: `pydoc_data.topics`, one document per topic, in key order."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def _without_overlap(docs: list[str], heldout: list[str], min_line: int = 60) -> list[str]:
    lines = {ln.strip() for t in heldout for ln in t.splitlines() if len(ln.strip()) >= min_line}
    return [d for d in docs if not any(ln.strip() in lines for ln in d.splitlines() if len(ln.strip()) >= min_line)]


@functools.lru_cache(maxsize=None)
def _stdlib_docstrings(min_chars: int) -> tuple[str, ...]:
    docs: list[str] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        module = _quiet_import(name)
        if module is not None:
            docs.extend(d for d in _docs_of(module) if len(d) >= min_chars)
    return tuple(_without_overlap(list(dict.fromkeys(docs)), language_reference_topics()))


def stdlib_docstrings(min_chars: int = 300) -> list[str]:
    """The training text: standard-library docstrings of at least `min_chars` characters, in module-name
    order, without any that share a long line with the held-out topics."""
    return list(_stdlib_docstrings(min_chars))


#: source folders never read: the test suites, GUI and demo code, the held-out topics, vendored or generated
#: trees (codec tables, installed packages)
SKIP_SOURCE_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                              "venv", "pydoc_data", "encodings", "site-packages", "dist-packages", "__pycache__"})


def _source_files(root: Path) -> list[Path]:
    """The stdlib's .py files outside SKIP_SOURCE_DIRS and the build's config folder, tests excluded, sorted."""
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if any(d in SKIP_SOURCE_DIRS or d.startswith("config-") for d in parts[:-1]) or parts[-1].startswith("test_"):
            continue
        out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _stdlib_sources(max_chars: int, root: str) -> tuple[str, ...]:
    base = Path(root)
    files = sorted(_source_files(base), key=lambda p: hashlib.sha1(p.relative_to(base).as_posix().encode()).hexdigest())
    texts = [t for t in (p.read_text(encoding="utf-8", errors="replace").strip() for p in files) if t]
    docs, total = [], 0
    for text in _without_overlap(texts, language_reference_topics()):
        if total + len(text) <= max_chars:   # a file too long for what is left is skipped: a shorter one may fit
            docs.append(text)
            total += len(text)
    return tuple(docs)


def stdlib_sources(max_chars: int = 2_000_000) -> list[str]:
    """More training text: whole source files of the standard library (one document each), in a fixed order
    (the SHA-1 of each file's path under the stdlib folder), at most `max_chars` characters in all, without any
    file that shares a long line with the held-out topics."""
    return list(_stdlib_sources(max_chars, sysconfig.get_paths()["stdlib"]))


#: names that every data option accepts (`data.train=python-docs`, `eval ppl --text python-reference`)
BUILTIN_TEXTS = {"python-docs": stdlib_docstrings, "python-source": stdlib_sources,
                 "python-reference": language_reference_topics}


def builtin_texts(name: str) -> list[str] | None:
    """The documents of a built-in text by name, None when `name` is not one. `python-source:SIZE` takes another
    share of the source files than the default 2 MB: SIZE in characters, with k or M (`python-source:4M`)."""
    base, colon, size = name.partition(":")
    if colon and base == "python-source":
        return stdlib_sources(_chars(size, name))
    fn = BUILTIN_TEXTS.get(name)
    return fn() if fn else None


def _chars(size: str, name: str) -> int:
    scale = {"k": 1_000, "m": 1_000_000}.get(size[-1:].lower(), 1)
    digits = size[:-1] if scale > 1 else size
    try:
        n = int(float(digits) * scale)
    except ValueError:
        n = 0
    if n <= 0:
        raise UserError(f"{name}: give the size in characters, e.g. python-source:4M or python-source:500k")
    return n
