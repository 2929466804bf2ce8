"""Settings: the README starts with the two commands, docs/settings.md documents every setting; values are
checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
SETTINGS_DOC = (REPO / "docs" / "settings.md").read_text()


def test_readme_starts_with_the_two_commands() -> None:
    lines = [ln for ln in README.splitlines() if ln.strip() and not ln.startswith("```")]
    assert lines[0].startswith("make serve")
    assert lines[1].startswith("make test")


def test_readme_stays_a_first_page() -> None:
    """The two commands and a short summary; tables and figures live in docs/ (models.md, benchmarks.md)."""
    assert len(README.splitlines()) <= 150


def test_every_setting_is_in_the_settings_table() -> None:
    missing = [name for name in Settings.model_fields if f"`RAGSPEC_{name.upper()}`" not in SETTINGS_DOC]
    assert not missing, f"settings missing from docs/settings.md: {missing}"


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
        assert getattr(Settings(**{name: 0}), name) == 0  # type: ignore[call-arg, arg-type]  # 0 means: the whole window / none / off
        with pytest.raises(ValidationError, match=name):
            Settings(**{name: -1})  # type: ignore[call-arg, arg-type]


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
            Settings(**{name: bad})  # type: ignore[call-arg, arg-type]


def test_kv_byte_settings_take_a_byte_count_or_auto_with_a_one_line_error(monkeypatch: Any) -> None:
    import pytest
    from pydantic import ValidationError

    for name in ("kv_cache_bytes", "kv_host_bytes", "kv_pool_bytes"):
        env = f"RAGSPEC_{name.upper()}"
        for text, value in (("AUTO", "auto"), (" Auto ", "auto"), ("8589934592", 8 << 30), ("0", 0)):
            monkeypatch.setenv(env, text)
            assert getattr(Settings(), name) == value  # type: ignore[call-arg]
        assert getattr(Settings(**{name: 123}), name) == 123  # type: ignore[call-arg, arg-type]
        for bad in ("8GiB", "-1", "1.5", "automatic"):
            monkeypatch.setenv(env, bad)
            with pytest.raises(ValidationError) as caught:
                Settings()  # type: ignore[call-arg]
            errors = caught.value.errors()
            assert len(errors) == 1 and errors[0]["loc"] == (name,)
            assert errors[0]["msg"] == "Value error, must be a byte count (integer) or auto"
        monkeypatch.delenv(env)
        for bad_value in (-1, True, 2.5):
            with pytest.raises(ValidationError, match="must be a byte count"):
                Settings(**{name: bad_value})  # type: ignore[call-arg, arg-type]


def test_rope_scaling_is_checked_when_the_settings_are_read(monkeypatch: Any) -> None:
    import pytest
    from pydantic import ValidationError

    from app.settings import ROPE_SCALING_FORM

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    monkeypatch.setenv("RAGSPEC_ROPE_SCALING", '{"rope_type": "yarn", "factor": 4.0, '
                       '"original_max_position_embeddings": 32768}')
    assert Settings().rope_scaling == yarn  # type: ignore[call-arg]
    linear = Settings(rope_scaling={"type": "linear", "factor": 2}).rope_scaling  # type: ignore[call-arg]
    assert linear == {"type": "linear", "factor": 2}  # the older key, as load_model takes it
    assert 'like {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}' in ROPE_SCALING_FORM
    for text in ("{rope_type: yarn}", "yarn", "[4.0]", "4"):  # not JSON, or JSON but no object
        monkeypatch.setenv("RAGSPEC_ROPE_SCALING", text)
        with pytest.raises(ValidationError) as caught:
            Settings()  # type: ignore[call-arg]
        errors = caught.value.errors()
        assert len(errors) == 1 and errors[0]["loc"] == ("rope_scaling",)
        assert errors[0]["msg"] == f"Value error, {ROPE_SCALING_FORM}"
    monkeypatch.delenv("RAGSPEC_ROPE_SCALING")
    # the checks load_model runs (decoding.runtime.rope), before any model is loaded
    for bad, message in (({"rope_type": "dynamic", "factor": 2.0}, "type 'dynamic' is not supported"),
                         ({"factor": 2.0}, "type None is not supported"),
                         ({"rope_type": "yarn", "factor": 0.5}, "numeric factor >= 1, not 0.5"),
                         ({"rope_type": "linear", "factor": "4"}, "numeric factor >= 1, not '4'"),
                         ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 3.5},
                          "original_max_position_embeddings must be a positive integer, not 3.5")):
        with pytest.raises(ValidationError, match="rope_scaling") as caught:
            Settings(rope_scaling=bad)  # type: ignore[call-arg]
        assert message in caught.value.errors()[0]["msg"]


def test_prefill_chunk_refuses_zero_and_non_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAGSPEC_PREFILL_CHUNK: unset means by device; a chunk of 0 rows, a negative one or a word is refused."""
    from pydantic import ValidationError

    assert Settings().prefill_chunk is None  # type: ignore[call-arg]
    for value in ("0", "-256", "big"):
        monkeypatch.setenv("RAGSPEC_PREFILL_CHUNK", value)
        with pytest.raises(ValidationError, match="prefill_chunk"):
            Settings()  # type: ignore[call-arg]
    monkeypatch.setenv("RAGSPEC_PREFILL_CHUNK", "1024")
    assert Settings().prefill_chunk == 1024  # type: ignore[call-arg]


def test_batching_settings_refuse_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAGSPEC_MAX_BATCH and RAGSPEC_PREFILL_ROWS_PER_STEP: no generation at once, or no prompt rows per forward
    (or more than a causal batch item takes), is refused when the settings are read."""
    from pydantic import ValidationError

    for env, values in (("RAGSPEC_MAX_BATCH", ("0", "-1", "65", "many")),
                        ("RAGSPEC_PREFILL_ROWS_PER_STEP", ("0", "129", "some"))):
        for value in values:
            monkeypatch.setenv(env, value)
            with pytest.raises(ValidationError, match=env.removeprefix("RAGSPEC_").lower()):
                Settings()  # type: ignore[call-arg]
        monkeypatch.delenv(env)
    monkeypatch.setenv("RAGSPEC_MAX_BATCH", "1")
    assert Settings().max_batch == 1  # type: ignore[call-arg]


def test_settings_are_their_concerns_fields_in_order() -> None:
    """``Settings`` is the concern models composed: every field is one concern's, in the concerns' order (the data
    dir first, which the documents and models dirs are derived from)."""
    from app.settings import GROUPS

    assert all(issubclass(Settings, group) for group in GROUPS)
    assert list(Settings.model_fields) == [name for group in GROUPS for name in group.model_fields]
    assert next(iter(Settings.model_fields)) == "data_dir"


def test_the_directories_follow_the_data_dir_unless_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(data_dir=tmp_path)  # type: ignore[call-arg]
    assert (settings.documents_dir, settings.models_dir) == (tmp_path / "documents", tmp_path / "models")
    monkeypatch.setenv("RAGSPEC_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("RAGSPEC_MODELS_DIR", str(tmp_path / "models-elsewhere"))
    settings = Settings()  # type: ignore[call-arg]
    assert settings.documents_dir == tmp_path / "env" / "documents"
    assert settings.models_dir == tmp_path / "models-elsewhere"
    settings = Settings(data_dir=tmp_path / "given")  # type: ignore[call-arg]  # an argument wins over the variable
    assert settings.documents_dir == tmp_path / "given" / "documents"


def _table_sections() -> list[list[str]]:
    """The variables of docs/settings.md's tables, one list per section (``## ...``) that has a table."""
    sections: list[list[str]] = []
    for section in SETTINGS_DOC.split("\n## ")[1:]:
        names = [line.split("|")[1].strip().strip("`") for line in section.splitlines()
                 if line.startswith("| `RAGSPEC_")]
        if names:
            sections.append(names)
    return sections


def test_the_settings_table_is_grouped_as_the_settings_are() -> None:
    """One section of docs/settings.md per concern model, in their order, each naming exactly its fields."""
    from app.settings import GROUPS

    expected = [[f"RAGSPEC_{name.upper()}" for name in group.model_fields] for group in GROUPS]
    assert _table_sections() == expected
    for group in GROUPS:
        assert f"(`{group.__name__}`)" in SETTINGS_DOC


def test_reasoning_effort_is_low_unless_set_and_another_value_stops_the_start_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """RAGSPEC_REASONING_EFFORT (a harmony template's ``reasoning_effort``: tests/app/test_harmony.py): low by
    default, low / medium / high taken, anything else refused before anything loads, in one line."""
    from app.cli.main import main

    assert Settings().reasoning_effort == "low"  # type: ignore[call-arg]
    for value in ("low", "medium", "high"):
        monkeypatch.setenv("RAGSPEC_REASONING_EFFORT", value)
        assert Settings().reasoning_effort == value  # type: ignore[call-arg]
    monkeypatch.setenv("RAGSPEC_REASONING_EFFORT", "extreme")
    assert main(["serve"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("ragspec: bad setting: RAGSPEC_REASONING_EFFORT: Input should be 'low', 'medium' or "
                            "'high'\n") and captured.out == ""
