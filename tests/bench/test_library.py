"""bench.library: 1,000+ documents of Python's own documentation (PSF licence), 1-8 KB each, the same ones in the
same order on every call and in every interpreter, with exact 1% / 10% tiers for filter benchmarks."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.library import (
    LICENCE,
    MAX_BYTES,
    MIN_BYTES,
    YEARS,
    LibraryDoc,
    all_documents,
    fingerprint,
    library_documents,
)
from tests.conftest import REPO


@pytest.fixture(scope="module")
def docs() -> list[LibraryDoc]:
    return library_documents(1200)


def test_at_least_a_thousand_documents_of_one_to_eight_kb(docs: list[LibraryDoc]) -> None:
    assert len(docs) == 1200
    assert len(all_documents()) >= 1200
    titles = [d.title for d in docs]
    assert len(set(titles)) == len(titles)
    for d in docs:
        assert d.text.strip() and d.title.strip()
        assert d.text.startswith(d.title + "\n\n")
        size = len(d.text.encode("utf-8"))
        assert MIN_BYTES <= size <= MAX_BYTES, (d.title, size)
        assert d.attributes["size_kb"] == max(1, round(size / 1024))
    sizes = Counter(d.attributes["size_kb"] for d in docs)
    assert sizes[1] + sizes[2] < len(docs) * 0.9 and sum(v for k, v in sizes.items() if int(k) >= 5) >= 20


def test_attributes_for_filters(docs: list[LibraryDoc]) -> None:
    tiers = Counter(d.attributes["tier"] for d in docs)
    assert tiers == {"gold": 12, "silver": 108, "bronze": 1080}  # 1% gold; gold or silver 10%
    kinds = Counter(d.attributes["kind"] for d in docs)
    assert set(kinds) == {"module", "class", "topic"} and kinds["module"] > 300 and kinds["class"] > 300
    assert {d.attributes["year"] for d in docs} == set(range(YEARS[0], YEARS[1] + 1))
    assert 0 < sum(bool(d.attributes["deprecated"]) for d in docs) < len(docs) * 0.1
    packages = Counter(d.attributes["package"] for d in docs)
    assert len(packages) > 100 and {"os", "json", "email", "asyncio", "builtins", "reference"} <= set(packages)
    for d in docs:
        assert isinstance(d.attributes["deprecated"], bool) and isinstance(d.attributes["year"], int)
        assert d.licence == LICENCE and f"CPython {platform.python_version()}" in d.source


def test_the_same_documents_on_every_call_and_every_seed_picks_its_own(docs: list[LibraryDoc]) -> None:
    assert library_documents(1200) == docs
    other = library_documents(1000, seed=1)
    assert len(other) == 1000 and {d.title for d in other} != {d.title for d in docs[:1000]}
    assert Counter(d.attributes["tier"] for d in other) == {"gold": 10, "silver": 90, "bronze": 900}


def test_no_trace_of_the_machine(docs: list[LibraryDoc]) -> None:
    """Signatures show no memory addresses, no paths of this installation, no venv."""
    local = {sys.prefix, sys.base_prefix, sys.executable, str(REPO), os.path.expanduser("~")} - {"/", ""}
    for d in docs:
        assert " at 0x" not in d.text, d.title
        assert not any(p in d.text for p in local), d.title


def test_too_many_is_an_error_naming_how_many_there_are() -> None:
    with pytest.raises(ValueError, match=r"gives \d{4} documents .* fewer than the 100000 asked for"):
        library_documents(100_000)


def test_the_cli_writes_the_same_library_in_another_interpreter(docs: list[LibraryDoc], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "123", "LC_ALL": "C", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "bench.library", "--n", "1200", "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True)
    assert "1200 documents" in proc.stdout
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["fingerprint"] == fingerprint(docs) and index["n"] == 1200
    assert [e["title"] for e in index["documents"]] == [d.title for d in docs]
    first = index["documents"][0]
    assert first["file"] == "0000.txt" and first["attributes"] == docs[0].attributes
    assert first["licence"] == LICENCE and first["source"] == docs[0].source
    assert (tmp_path / "1199.txt").read_text(encoding="utf-8") == docs[-1].text
