"""A library of 1,000+ real-text documents for the collections benchmark, generated offline on any machine.

The text is Python's own documentation as the running interpreter holds it: the docstrings of the standard
library's modules, classes and functions (with each function's signature), rendered as plain text the way
``pydoc`` shows them, and the language reference's sections that ``help()`` reads (``pydoc_data.topics``).
All of it is under the PSF licence (permissive), real English prose and technical writing, and on every
machine with CPython: nothing is downloaded and nothing is made up.

How it is cut (every document 1-8 KB of UTF-8). Each title draws from a hash the size it is cut at (1.5, 3, 5 or 7
KB: ``PART_SIZES``, a long tail as in a real library). A module up to its size is one document (``kind``
"module"); a larger one gives each class of 1 KB or more a document of its own (``kind`` "class"), and a
document over its size is cut into parts of about equal size between members, then paragraphs ("json (part 2 of
3)"). Modules under 1 KB are merged with the next ones of the same package ("a + b"), or dropped. A reference
section is a document of its own (``kind`` "topic", package "reference"), cut the same way.

Only docstrings and signatures are rendered, never a module's data (no ``os.environ``, no paths), and a default
value that is not a plain literal is shown by its type. The modules are read in a fresh interpreter (``python -I
-S``) so that what the calling process imported or patched cannot change them, with warnings silenced and stdout
held; modules with side effects on import, Windows-only ones, tests, what Debian ships apart or patches
(tkinter, idlelib, distutils, site, sysconfig...) are never imported (``SKIP``). So the same CPython release
gives the same documents in the same order on any machine, whatever its locale, environment or venv
(``fingerprint`` checks it in one hash). Another patch release of the same minor version gives the same modules
but not quite the same text (docstrings are fixed in patch releases: 3.11.2 and 3.11.7 differ in about half of
the documents): each document's ``source`` names the release.

``library_documents(n, seed)`` returns ``n`` of them (a seeded choice when there are more, in the library's
order; a ValueError naming how many there are when there are fewer), each with attributes for filter benchmarks:
``package``, ``module``, ``kind``, ``size_kb``, ``year`` (2015-2026, from a hash of the title), ``tier``
(exactly 1% "gold", 9% "silver", the rest "bronze" where ``n`` is a multiple of 100) and ``deprecated`` (the
module is on its way out, PEP 594's and the like, or the docstring's first paragraph says deprecated).

    python -m bench.library [--n 1200] [--seed 0] --out DIR

writes DIR/0000.txt ... and DIR/index.json (per file: title, attributes, source, licence), for uploading.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import platform
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LICENCE = "PSF-2.0"  # Python Software Foundation License Version 2: CPython's docstrings and documentation
MIN_BYTES = 1024
MAX_BYTES = 8192
# The most a document may hold before it is cut, drawn per title from a hash (bytes, weight in %): a long tail of
# sizes, as a real library has, with as many documents as Python's documentation gives (about 2.6 MB of text).
PART_SIZES = ((1536, 50), (3072, 25), (5120, 15), (7168, 10))
YEARS = (2015, 2026)

# Never imported: side effects (a browser, the Zen printed, windows), Windows-only, tests, what Debian ships in
# separate packages (so a machine may lack it) or setuptools replaces (distutils), optional C extensions that
# builds often lack, codecs (generated boilerplate), the twins of modules documented in their own right
# (posix is os, sre_* are re's), and site and sysconfig, whose text and defaults depend on the installation
# (a venv's default scheme is "venv"; Debian patches both).
SKIP = frozenset({
    "antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "test", "lib2to3", "distutils",
    "ensurepip", "readline", "rlcompleter", "msilib", "msvcrt", "winreg", "winsound", "nt", "ntpath", "nturl2path",
    "posix", "pydoc_data", "ossaudiodev", "nis", "spwd", "crypt", "dbm.gnu", "curses.panel", "sre_compile",
    "sre_constants", "sre_parse", "encodings", "asyncio.windows_events", "asyncio.windows_utils",
    "multiprocessing.popen_spawn_win32", "ctypes.wintypes", "ctypes.macholib", "xml.etree.cElementTree", "site",
    "sysconfig",
})
SKIP_PARTS = frozenset({"test", "tests", "idle_test", "__main__"})
# Private top-level modules written in Python whose docstrings are documented nowhere else (private submodules
# of the packages, such as email._header_value_parser, are read too; private C modules only through the public
# modules that export what they define).
PRIVATE_MODULES = ("_collections_abc", "_compat_pickle", "_compression", "_markupbase", "_sitebuiltins",
                   "_strptime", "_threading_local", "_weakrefset")
# Deprecated (to be removed) in 3.11-3.13: PEP 594's dead batteries and the older ones with a removal date.
DEPRECATED_MODULES = frozenset({
    "aifc", "asynchat", "asyncore", "audioop", "cgi", "cgitb", "chunk", "crypt", "imghdr", "imp", "mailcap",
    "msilib", "nis", "nntplib", "ossaudiodev", "pipes", "smtpd", "sndhdr", "spwd", "sunau", "telnetlib", "uu",
    "xdrlib", "distutils", "lib2to3",
})
_DEPRECATED_TEXT = re.compile(r"\b(deprecated|deprecation)\b", re.IGNORECASE)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_KEEP_DUNDERS = ("__init__", "__call__")


@dataclass(frozen=True)
class LibraryDoc:
    """One document of the library: ``text`` (1-8 KB of UTF-8) with the attributes a filter can use."""

    title: str
    text: str
    attributes: dict[str, str | int | bool]
    source: str
    licence: str = LICENCE


@dataclass
class Draft:
    """A document before the choice of ``n``: its title, text, where it comes from and its kind."""

    title: str
    text: str
    module: str  # the module, or "reference" for a language-reference section
    kind: str  # "module", "class" or "topic"
    deprecated: bool
    source: str

    @property
    def size(self) -> int:
        return _bytes(self.text)


def python_version() -> str:
    return platform.python_version()


def _bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _first_paragraph(text: str) -> str:
    """The first paragraph of a docstring, or of a reference section after its heading."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip() and not re.fullmatch(r"[^\n]+\n[=*]+", p.strip())]
    return paragraphs[0] if paragraphs else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ---- which modules ------------------------------------------------------------------------------------------


def _skipped(name: str) -> bool:
    parts = name.split(".")
    return ((parts[0].startswith("_") and parts[0] not in PRIVATE_MODULES)
            or any(p in SKIP_PARTS or p.startswith("__") for p in parts)
            or any(".".join(parts[: i + 1]) in SKIP for i in range(len(parts))))


def _import(name: str) -> types.ModuleType | None:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):  # a module that cannot be imported here is left out
            return None


def stdlib_modules() -> list[tuple[str, types.ModuleType]]:
    """Every standard-library module and submodule read here (safe to import, not skipped), sorted by name."""
    found: dict[str, types.ModuleType] = {}
    pending = sorted({n for n in (*sys.stdlib_module_names, *PRIVATE_MODULES) if not _skipped(n)})
    while pending:
        name = pending.pop(0)
        if name in found:
            continue
        module = _import(name)
        if module is None or getattr(module, "__name__", None) != name:
            continue  # an alias (os.path is posixpath): documented under its own name
        found[name] = module
        path = getattr(module, "__path__", None)
        if path is not None:
            subs = (info.name for info in pkgutil.iter_modules(list(path), prefix=name + "."))
            pending = sorted({*pending, *(s for s in subs if not _skipped(s))})
    return sorted(found.items())


# ---- rendering ----------------------------------------------------------------------------------------------


class _Shown:
    """A default value as the documents show it (its repr might be a memory address or this machine's setting)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= 60 and (os.sep not in value or value == os.sep)
    if isinstance(value, bytes):
        return len(value) <= 60
    if value is None or isinstance(value, bool | int | float | complex):
        return True
    if isinstance(value, tuple | list | frozenset | set) and len(value) <= 8:
        return all(_plain(v) for v in value)
    return False


def _shown_default(value: Any) -> Any:
    if _plain(value) or isinstance(value, enum.Enum):
        return value
    if isinstance(value, type):
        return _Shown(f"{value.__module__}.{value.__qualname__}")
    if callable(value) and isinstance(getattr(value, "__qualname__", None), str):
        return _Shown(value.__qualname__)
    return _Shown(f"<{type(value).__qualname__}>")


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
        params = [p.replace(default=_shown_default(p.default)) if p.default is not p.empty else p
                  for p in sig.parameters.values()]
        return str(sig.replace(parameters=params))
    except Exception:  # none to be had (a C function without a text signature, or one that cannot be evaluated)
        return "(...)"


def _doc(obj: Any) -> str:
    doc = getattr(obj, "__doc__", None)  # its own docstring: a class's is not inherited, unlike inspect.getdoc
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else ""


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.splitlines())


def _function_block(name: str, obj: Any) -> str:
    doc = _doc(obj)
    return f"{name}{_signature(obj)}" + ("\n" + _indent(doc) if doc else "")


def _members(cls: type) -> list[str]:
    """The methods and properties ``cls`` defines itself: public ones, and documented private ones."""
    blocks: list[str] = []
    for name, raw in sorted(vars(cls).items(), key=lambda item: (_private(item[0]), item[0])):
        member = raw.__func__ if isinstance(raw, classmethod | staticmethod) else raw
        documented = bool(_doc(member))
        if name.startswith("__") and name not in _KEEP_DUNDERS:
            continue  # the other special methods
        if (_private(name) or name in _KEEP_DUNDERS) and not documented:
            continue
        if isinstance(member, property):
            if documented:
                blocks.append(f"{name} (property)\n{_indent(_doc(member))}")
        elif inspect.isroutine(member):
            blocks.append(_function_block(name, member))
    return blocks


def _class_units(cls: type) -> list[str]:
    """The class as units: its head with its docstring, then one per member, indented under it."""
    bases = ", ".join(b.__qualname__ if b.__module__ in ("builtins", cls.__module__)
                      else f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__)
    doc = _doc(cls)
    head = f"class {cls.__name__}({bases})" + ("\n" + _indent(doc) if doc else "")
    return [head] + [_indent(block) for block in _members(cls)]


def _worth(obj: Any) -> bool:
    """A private class or function is read when it has a docstring (a class: or a documented member)."""
    return bool(_doc(obj)) or (inspect.isclass(obj) and any("\n" in u for u in _class_units(obj)[1:]))


# ---- what each module documents -----------------------------------------------------------------------------


def _documentable(obj: Any) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj)


def _exports(module: types.ModuleType) -> list[str]:
    """The names a module exports: ``__all__`` where it has one, else its public names."""
    exported = getattr(module, "__all__", None)
    if isinstance(exported, list | tuple):
        return sorted({n for n in exported if isinstance(n, str)})
    return sorted(n for n in vars(module) if not n.startswith("_"))


def _homes(modules: Sequence[tuple[str, types.ModuleType]]) -> dict[int, str]:
    """Where each class or function is documented (by ``id``): the public module that defines it; else (defined in
    a C module, such as ``_heapq`` or ``posix``, or a private one) the first public module exporting it, packages
    before their submodules; else the private module read here that defines it."""
    read = {name for name, _ in modules}
    public = sorted(((n, m) for n, m in modules if not any(_private(p) for p in n.split("."))),
                    key=lambda nm: (nm[0].count("."), nm[0]))
    public_names = {n for n, _ in public}
    homes: dict[int, str] = {}
    for name, module in public:
        for obj in vars(module).values():
            if _documentable(obj) and getattr(obj, "__module__", None) == name:
                homes.setdefault(id(obj), name)
    for name, module in public:
        for attr in _exports(module):
            obj = getattr(module, attr, None)
            if _documentable(obj) and getattr(obj, "__module__", None) not in public_names:
                homes.setdefault(id(obj), name)
    for name, module in modules:
        for obj in vars(module).values():
            if _documentable(obj) and getattr(obj, "__module__", None) == name and name in read:
                homes.setdefault(id(obj), name)
    return homes


def _module_content(name: str, module: types.ModuleType, homes: dict[int, str]) -> tuple[
        str, list[str], list[tuple[str, type]]]:
    """The module's docstring, its functions (rendered) and its classes: what it exports or defines, public first
    then the documented private ones."""
    functions: list[str] = []
    classes: list[tuple[str, type]] = []
    seen: set[int] = set()
    names = sorted(set(_exports(module)) | {n for n in vars(module) if n != "__builtins__"},
                   key=lambda n: (_private(n), n))
    for attr in names:
        obj = getattr(module, attr, None)
        if not _documentable(obj) or homes.get(id(obj)) != name or id(obj) in seen:
            continue
        if attr.startswith("__") or (_private(attr) and not _worth(obj)):
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            classes.append((attr, obj))
        else:
            functions.append(_function_block(attr, obj))
    return _doc(module), functions, classes


# ---- cutting into documents of 1-8 KB -----------------------------------------------------------------------


def _split_unit(unit: str, limit: int) -> list[str]:
    """A unit over ``limit`` bytes cut between paragraphs, then lines, then words."""
    if _bytes(unit) <= limit:
        return [unit]
    for sep in ("\n\n", "\n", " "):
        pieces = unit.split(sep)
        if len(pieces) > 1:
            out: list[str] = []
            cur = ""
            for piece in pieces:
                cand = piece if not cur else cur + sep + piece
                if cur and _bytes(cand) > limit:
                    out.append(cur)
                    cur = piece
                else:
                    cur = cand
            out.append(cur)
            return [s for part in out for s in _split_unit(part, limit)]
    return [unit[: limit // 4], *_split_unit(unit[limit // 4 :], limit)]


def part_bytes(title: str) -> int:
    """The size a document titled ``title`` is cut at (PART_SIZES: the same for the same title everywhere)."""
    draw = _hash("size\0" + title) % sum(w for _, w in PART_SIZES)
    for size, weight in PART_SIZES:
        if draw < weight:
            return size
        draw -= weight
    raise AssertionError("unreachable")


def _pack(title: str, units: list[str], module: str, kind: str, deprecated: bool, source: str) -> list[Draft]:
    """``units`` under ``title``: one document up to ``part_bytes(title)``, else parts of about equal size."""
    header = 40 + _bytes(title)  # the title line of a part
    limit = part_bytes(title)
    units = [s for u in units for s in _split_unit(u, max(MIN_BYTES // 2, limit // 3))]
    body = _bytes("\n\n".join(units))
    if body + header <= limit or body + header < 2 * MIN_BYTES:
        text = f"{title}\n\n" + "\n\n".join(units) + "\n"
        return [Draft(title, text, module, kind, deprecated, source)]
    k = math.ceil(body / (limit - header))
    while k > 1 and body / k < MIN_BYTES:
        k -= 1
    target = body / k
    parts: list[list[str]] = [[]]
    size = 0
    for unit in units:
        n = _bytes(unit) + 2
        if parts[-1] and (size + n / 2 > target or size + n > MAX_BYTES - header):
            parts.append([])
            size = 0
        parts[-1].append(unit)
        size += n
    if len(parts) > 1 and sum(_bytes(u) + 2 for u in parts[-1]) < MIN_BYTES \
            and sum(_bytes(u) + 2 for u in parts[-2] + parts[-1]) <= MAX_BYTES - header:
        last = parts.pop()
        parts[-1] += last
    drafts = []
    for i, part in enumerate(parts, 1):
        part_title = f"{title} (part {i} of {len(parts)})" if len(parts) > 1 else title
        text = f"{part_title}\n\n" + "\n\n".join(part) + "\n"
        drafts.append(Draft(part_title, text, module, kind, deprecated, source))
    return drafts


def _source(what: str) -> str:
    return f"CPython {python_version()} documentation: {what}"


def _module_drafts(name: str, module: types.ModuleType, homes: dict[int, str]) -> list[Draft]:
    doc, functions, classes = _module_content(name, module, homes)
    deprecated = name.split(".")[0] in DEPRECATED_MODULES or bool(_DEPRECATED_TEXT.search(_first_paragraph(doc)))
    source = _source(f"docstrings of {name}")
    class_units = {attr: _class_units(cls) for attr, cls in classes}

    def module_units(inline: Sequence[str]) -> list[str]:
        units = [doc] if doc else []
        if functions:
            units += ["Functions", *(_indent(f) for f in functions)]
        if inline:
            units += ["Classes", *(_indent(u) for attr in inline for u in class_units[attr])]
        return units

    whole = module_units(list(class_units))
    if _bytes("\n\n".join(whole)) + 40 + _bytes(name) <= part_bytes(name):
        return _pack(name, whole, name, "module", deprecated, source)
    big = [attr for attr, units in class_units.items() if _bytes("\n\n".join(units)) >= MIN_BYTES]
    small = [attr for attr in class_units if attr not in big]
    drafts = _pack(name, module_units(small), name, "module", deprecated, source) if doc or functions or small \
        else []
    classes_by_name = dict(classes)
    for attr in big:
        first = _first_paragraph(_doc(classes_by_name[attr]))
        drafts += _pack(f"{name}.{attr}", class_units[attr], name, "class",
                        deprecated or bool(_DEPRECATED_TEXT.search(first)), source)
    return drafts


def _topic_drafts() -> list[Draft]:
    """The language reference's sections that ``help()`` shows (``pydoc_data.topics``), one document each."""
    topics = _import("pydoc_data.topics")
    found: dict[str, str] = getattr(topics, "topics", None) or {}
    drafts: list[Draft] = []
    seen: dict[str, str] = {}
    for key in sorted(found):
        text = found[key].strip()
        if not text or text in seen.values():
            continue  # "else" is "if"
        seen[key] = text
        heading = text.split("\n", 1)[0].strip()
        title = f"Python reference: {heading}"
        if any(d.title == title or d.title.startswith(title + " (part") for d in drafts):
            title = f"{title} [{key}]"
        units = re.split(r"\n{2,}(?=[^\n]+\n[=*-]{3,}\n)", text)  # at the section headings
        drafts += _pack(title, units, "reference", "topic", bool(_DEPRECATED_TEXT.search(_first_paragraph(text))),
                        _source(f"pydoc_data.topics[{key!r}] (the language reference)"))
    return drafts


def _merge_small(drafts: list[Draft]) -> list[Draft]:
    """Documents under MIN_BYTES merged with the next ones of the same package until 1 KB; what is left, dropped."""
    out: list[Draft] = []
    group: list[Draft] = []

    def package(d: Draft) -> str:
        return d.module.split(".")[0]

    def flush() -> None:
        if len(group) == 1:
            out.append(group[0])
        elif group:
            title = " + ".join(d.title for d in group)
            text = f"{title}\n\n" + "\n\n".join(d.text.rstrip("\n") for d in group) + "\n"
            source = _source(" + ".join(d.source.removeprefix(_source("")) for d in group))
            out.append(Draft(title, text, group[0].module, group[0].kind, any(d.deprecated for d in group), source))
        group.clear()

    for d in drafts:
        if d.size >= MIN_BYTES:
            out.append(d)
            continue
        if group and (package(group[0]) != package(d) or group[0].kind != d.kind
                      or sum(g.size + 2 for g in group) + d.size > MAX_BYTES):
            group.clear()  # too small to stand alone
        group.append(d)
        if sum(g.size + 2 for g in group) >= MIN_BYTES:
            flush()
    return [d for d in out if MIN_BYTES <= d.size <= MAX_BYTES]


def collect_drafts() -> list[Draft]:
    """Every document of the library read in this process (see ``all_documents``)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # reading typing.io's docstring warns, for one
        modules = stdlib_modules()
        homes = _homes(modules)
        drafts: list[Draft] = []
        for name, module in modules:
            drafts += _module_drafts(name, module, homes)
        for d in drafts:
            d.text = _ADDRESS.sub("", d.text)
        return _merge_small(drafts) + _merge_small(_topic_drafts())


def all_documents() -> list[Draft]:
    """Every document of the library, in its order: modules by name, then the reference sections. Read in a fresh
    interpreter (``-I -S``: no site-packages, no environment) so that what the calling process imported or patched
    (transformers adds methods to logging.Logger, logging.captureWarnings replaces warnings.showwarning) does not
    change the text."""
    with tempfile.TemporaryDirectory(prefix="ragspec-library-") as tmp:
        path = Path(tmp) / "drafts.json"
        proc = subprocess.run([sys.executable, "-I", "-S", str(Path(__file__).resolve()), "--drafts-json", str(path)],
                              capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"reading the standard library's documentation failed: {proc.stderr[-2000:]}")
        return [Draft(**d) for d in json.loads(path.read_text(encoding="utf-8"))]


# ---- choosing n and their attributes ------------------------------------------------------------------------


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def pseudo_year(title: str) -> int:
    """A year in YEARS from a hash of the title (for numeric range filters)."""
    return YEARS[0] + _hash(title) % (YEARS[1] - YEARS[0] + 1)


def library_documents(n: int = 1200, seed: int = 0) -> list[LibraryDoc]:
    """``n`` documents of Python's documentation (see the module docstring): the same ones in the same order for
    the same ``n``, ``seed`` and Python version. ValueError where the library has fewer than ``n``."""
    if n < 1:
        raise ValueError(f"n must be positive, not {n}")
    drafts = all_documents()
    if len(drafts) < n:
        raise ValueError(f"Python {python_version()}'s documentation gives {len(drafts)} documents of 1-8 KB here, "
                         f"fewer than the {n} asked for")
    ranked = sorted(range(len(drafts)), key=lambda i: (_hash(f"pick\0{seed}\0{drafts[i].title}"), i))
    chosen = sorted(ranked[:n])  # in the library's order
    by_tier = sorted(chosen, key=lambda i: (_hash(f"tier\0{seed}\0{drafts[i].title}"), i))
    gold, top = round(n / 100), round(n / 10)
    tier = {i: "gold" if r < gold else "silver" if r < top else "bronze" for r, i in enumerate(by_tier)}
    docs = []
    for i in chosen:
        d = drafts[i]
        attributes: dict[str, str | int | bool] = {
            "package": d.module.split(".")[0], "module": d.module, "kind": d.kind,
            "size_kb": max(1, round(d.size / 1024)), "year": pseudo_year(d.title), "tier": tier[i],
            "deprecated": d.deprecated,
        }
        docs.append(LibraryDoc(title=d.title, text=d.text, attributes=attributes, source=d.source))
    return docs


def fingerprint(docs: Sequence[LibraryDoc]) -> str:
    """One hash of every document (title, text, attributes, source, licence) in order: equal = the same library."""
    h = hashlib.sha256()
    for d in docs:
        h.update(json.dumps([d.title, d.text, d.attributes, d.source, d.licence], sort_keys=True).encode("utf-8"))
    return h.hexdigest()


def write_library(docs: Sequence[LibraryDoc], out_dir: Path, seed: int = 0) -> Path:
    """DIR/0000.txt ... and DIR/index.json; returns the index's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, d in enumerate(docs):
        name = f"{i:04d}.txt"
        (out_dir / name).write_text(d.text, encoding="utf-8")
        entries.append({"file": name, "title": d.title, "attributes": d.attributes, "source": d.source,
                        "licence": d.licence})
    index = {"python": python_version(), "n": len(docs), "seed": seed, "fingerprint": fingerprint(docs),
             "documents": entries}
    path = out_dir / "index.json"
    path.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.library",
                                     description="Write Python's documentation as N text files and index.json.")
    parser.add_argument("--n", type=int, default=1200, help="how many documents (default 1200)")
    parser.add_argument("--seed", type=int, default=0, help="which ones, where the library has more (default 0)")
    parser.add_argument("--out", type=Path, help="directory for NNNN.txt and index.json")
    parser.add_argument("--drafts-json", type=Path, help=argparse.SUPPRESS)  # all_documents' fresh interpreter
    args = parser.parse_args(argv)
    if args.drafts_json is not None:
        drafts = [dataclasses.asdict(d) for d in collect_drafts()]
        args.drafts_json.write_text(json.dumps(drafts, ensure_ascii=False), encoding="utf-8")
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    t0 = time.perf_counter()
    docs = library_documents(args.n, args.seed)
    seconds = time.perf_counter() - t0
    path = write_library(docs, args.out, args.seed)
    chars = sum(len(d.text) for d in docs)
    print(f"{len(docs)} documents, {chars} characters (~{chars // 4} tokens at 4 characters a token), "
          f"generated in {seconds:.1f} s from Python {python_version()}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
