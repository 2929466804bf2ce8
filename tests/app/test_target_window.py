"""The target's window at start (``app.services.load_target``): RAGSPEC_ROPE_SCALING (JSON) reaches the
loader, RAGSPEC_MAX_CONTEXT lowers the window or raises it up to what the rope scaling supports, and beyond
that the service refuses to start with both variables named. A tiny random Llama saved to a tmp dir, on a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.services import load_target
from app.settings import Settings
from decoding.errors import ModelLoadError
from tests.decoding.conftest import save_tiny_model

LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path)  # max_position_embeddings 256
    return path


def _settings(tiny: Path, tmp_path: Path, **values: object) -> Settings:
    return Settings(target_model=str(tiny), data_dir=tmp_path, cpu_quant="none", **values)  # type: ignore[arg-type]


def test_rope_scaling_from_the_environment_raises_the_window(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAGSPEC_ROPE_SCALING", '{"rope_type": "linear", "factor": 4.0}')
    monkeypatch.setenv("RAGSPEC_MAX_CONTEXT", "1024")
    settings = Settings(target_model=str(tiny), data_dir=tmp_path, cpu_quant="none")  # type: ignore[call-arg]
    assert settings.rope_scaling == LINEAR
    target = load_target(settings)
    assert target.max_context == 1024 and target.runtime.startswith("torch+rope-linearx4@256:")
    assert target.model.config.rope_scaling == LINEAR


def test_the_window_is_lowered_kept_or_refused(tiny: Path, tmp_path: Path) -> None:
    assert load_target(_settings(tiny, tmp_path)).max_context == 256  # the model's own
    assert load_target(_settings(tiny, tmp_path, rope_scaling=LINEAR, max_context=512)).max_context == 512
    assert load_target(_settings(tiny, tmp_path, rope_scaling=LINEAR)).max_context == 1024
    with pytest.raises(ModelLoadError, match=r"RAGSPEC_MAX_CONTEXT=300: .*beyond the 256 positions.*ROPE_SCALING"):
        load_target(_settings(tiny, tmp_path, max_context=300))  # was silently kept at 256 before
    with pytest.raises(ModelLoadError, match="beyond the 1024 positions"):
        load_target(_settings(tiny, tmp_path, rope_scaling=LINEAR, max_context=2048))
