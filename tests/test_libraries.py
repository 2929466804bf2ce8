"""The libraries' boundary: ``decoding`` and ``retrieval`` take plain arguments and read no environment
variables (settings are resolved in ``app`` and passed down)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _environment_reads(source: str) -> list[int]:
    """Lines that read the process environment: ``os.environ``, ``os.getenv``, ``environ`` / ``getenv``
    imported from ``os``."""
    names = ("environ", "getenv", "environb")
    lines = []
    for node in ast.walk(ast.parse(source)):
        attribute = isinstance(node, ast.Attribute) and node.attr in names
        imported = isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names)
        if attribute or imported:
            lines.append(node.lineno)
    return lines


def test_the_check_sees_environment_reads() -> None:
    assert _environment_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert _environment_reads("import os\nx = os.getenv('A')\n") == [2]
    assert _environment_reads("from os import environ\n") == [1]
    assert _environment_reads("import os\nx = os.path.join('a')\n") == []


def test_libraries_read_no_environment_variables() -> None:
    found = []
    for package in ("decoding", "retrieval"):
        for path in sorted((REPO / package).rglob("*.py")):
            found += [f"{path.relative_to(REPO)}:{line}" for line in _environment_reads(path.read_text())]
    assert not found, f"environment read in a library (resolve it in app/ and pass it down): {found}"


def _imported_packages(source: str) -> set[str]:
    """Top-level packages a module imports (anywhere in it, function-local imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.partition(".")[0])
    return found


def test_the_check_sees_imports() -> None:
    assert _imported_packages("import app.x\ndef f():\n    from decoding.tree import ROOT\n") == {"app", "decoding"}


def test_libraries_never_import_each_other_nor_the_app() -> None:
    """app -> decoding, app -> retrieval; decoding and retrieval never import each other nor app."""
    forbidden = {"decoding": {"retrieval", "app", "bench", "tests"}, "retrieval": {"decoding", "app", "bench", "tests"}}
    found = []
    for package, others in forbidden.items():
        for path in sorted((REPO / package).rglob("*.py")):
            imported = _imported_packages(path.read_text()) & others
            found += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(imported)]
    assert not found, found
