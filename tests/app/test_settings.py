"""Settings: the README starts with the two commands and documents every setting; values are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_starts_with_the_two_commands() -> None:
    lines = [ln for ln in README.splitlines() if ln.strip() and not ln.startswith("```")]
    assert lines[0].startswith("make serve")
    assert lines[1].startswith("make test")


def test_every_setting_is_in_the_readme_table() -> None:
    missing = [name for name in Settings.model_fields if f"`RAGSPEC_{name.upper()}`" not in README]
    assert not missing, f"settings missing from the README table: {missing}"


def test_chunk_overlap_is_bounded_by_half_the_chunk() -> None:
    import pytest
    from pydantic import ValidationError

    assert Settings(chunk_tokens=512, chunk_overlap=256).chunk_overlap == 256  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="chunk_overlap"):
        Settings(chunk_tokens=512, chunk_overlap=300)  # type: ignore[call-arg]


def test_long_document_and_kv_disk_settings_refuse_negative_values() -> None:
    import pytest
    from pydantic import ValidationError

    for name in ("long_document_budget", "long_document_lead", "kv_disk_bytes"):
        assert getattr(Settings(**{name: 0}), name) == 0  # 0 has a meaning: the whole window / none / off
        with pytest.raises(ValidationError, match=name):
            Settings(**{name: -1})


def test_retrieval_scoring_settings_are_checked(monkeypatch: Any) -> None:
    import pytest
    from pydantic import ValidationError

    monkeypatch.setenv("RAGSPEC_RETRIEVAL_SCORING", "dense")
    monkeypatch.setenv("RAGSPEC_RETRIEVAL_LEXICAL_WEIGHT", "0.4")
    settings = Settings()  # type: ignore[call-arg]
    assert (settings.retrieval_scoring, settings.retrieval_lexical_weight) == ("dense", 0.4)
    for name, bad in (("retrieval_scoring", "sparse"), ("retrieval_lexical_weight", 1.5),
                      ("retrieval_lexical_weight", -0.1)):
        with pytest.raises(ValidationError, match=name):
            Settings(**{name: bad})
