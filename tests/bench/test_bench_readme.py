"""bench/README.md lists every module of bench/ (a benchmark, one of its parts or a helper), and names no module
that is gone."""

from __future__ import annotations

import re

from tests.conftest import REPO


def test_the_bench_readme_lists_every_module() -> None:
    readme = (REPO / "bench" / "README.md").read_text()
    modules = {p.name for p in (REPO / "bench").glob("*.py") if p.name != "__init__.py"}
    named = set(re.findall(r"`(\w+\.py)`", readme))
    assert modules - named == set(), f"bench modules missing from bench/README.md: {sorted(modules - named)}"
    assert named - modules == set(), f"bench/README.md names modules that are gone: {sorted(named - modules)}"
