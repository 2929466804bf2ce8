"""Deploying a real model with docker-compose.yml (docs/operations.md "A real model on a GPU"), read through
``docker-compose config`` as in tests/app/test_deploy.py: the settings a real model needs pass through to
both services from the shell or a `.env` file, only when set; unset or empty they leave valid settings; the
env_file reaches the containers; host weights are mounted read-only at /models; the GPU service keeps its
device and waits longer before health failures count; the CUDA image gets accelerate (device_map loads).
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.app.test_deploy import COMPOSE_FILE, REPO, dockerfile_instructions, needs_compose, resolved

SERVICES = ("ragspec", "ragspec-gpu")
ENV_FILE = REPO / "ragspec.env"
# what docs/operations.md "A real model on a GPU" tells a deployer to set
PASSTHROUGH = {
    "RAGSPEC_TARGET_MODEL": "/models/Qwen2.5-7B-Instruct",
    "RAGSPEC_DRAFTER_MODEL": "/models/Qwen2.5-0.5B-Instruct",
    "RAGSPEC_EMBEDDING_MODEL": "/models/bge-m3",
    "RAGSPEC_EMBEDDING_KIND": "bge-m3",
    "RAGSPEC_DTYPE": "bfloat16",
    "RAGSPEC_CPU_QUANT": "q4_1",
    "RAGSPEC_MAX_CONTEXT": "131072",
    "RAGSPEC_ROPE_SCALING": '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}',
    "RAGSPEC_KV_CACHE_BYTES": "34359738368",
    "RAGSPEC_KV_HOST_BYTES": "8589934592",
    "RAGSPEC_KV_DISK_BYTES": "68719476736",
    "RAGSPEC_PREFILL_CHUNK": "4096",
}


def container_env(service: dict[str, Any]) -> dict[str, str]:
    """What the container gets: a name without a value (unset on the host) is dropped by Docker."""
    env = service.get("environment", {})
    assert isinstance(env, dict), "docker-compose config writes the environment as a mapping"
    return {str(k): str(v) for k, v in env.items() if v is not None}


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The service's Settings as that container environment gives them (nothing else of ours set)."""
    import os

    for name in [n for n in os.environ if n.startswith("RAGSPEC_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()  # type: ignore[call-arg]


def _volume(service: dict[str, Any], target: str) -> tuple[str, bool]:
    """(host source, read-only) of the mount at ``target``."""
    for vol in service.get("volumes", []):
        if isinstance(vol, dict) and vol["target"] == target:
            return str(vol["source"]), bool(vol.get("read_only"))
        if isinstance(vol, str) and vol.split(":")[1] == target:
            parts = vol.split(":")
            return parts[0], len(parts) > 2 and "ro" in parts[2].split(",")
    raise AssertionError(f"nothing mounted at {target}")


@needs_compose
@pytest.mark.parametrize("profile", [(), ("--profile", "gpu")], ids=["default", "gpu"])
def test_a_real_model_deploy_reaches_the_service(profile: tuple[str, ...], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    host_models = tmp_path / "weights"
    variables = {**PASSTHROUGH, "RAGSPEC_HOST_MODEL_DIR": str(host_models), "RAGSPEC_DEVICE": "cpu"}
    services = resolved(*profile, variables=variables)["services"]
    for name in SERVICES if profile else SERVICES[:1]:
        env = container_env(services[name])
        for variable, value in PASSTHROUGH.items():
            assert env.get(variable) == value, f"{name}: {variable}"
        assert _volume(services[name], "/models") == (str(host_models), True), f"{name}: weights read-only"
        settings = settings_from(env, monkeypatch)
        assert settings.target_model == "/models/Qwen2.5-7B-Instruct" and settings.max_context == 131072
        assert settings.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        assert settings.embedding_kind == "bge-m3" and settings.kv_disk_bytes == 64 << 30
        assert settings.kv_host_bytes == 8 << 30 and settings.prefill_chunk == 4096
    # the device is the service's, whatever the shell says
    assert container_env(services["ragspec"])["RAGSPEC_DEVICE"] == "cpu"
    if profile:
        assert container_env(services["ragspec-gpu"])["RAGSPEC_DEVICE"] == "cuda"


@needs_compose
def test_unset_or_empty_passthrough_leaves_valid_default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing set: the variables do not reach the containers at all. Set empty (`VAR=` in .env): they arrive
    as "" and count as unset (an empty RAGSPEC_MAX_CONTEXT would otherwise fail the start)."""
    defaults = settings_from({}, monkeypatch)
    unset = resolved("--profile", "gpu")["services"]
    empty = resolved("--profile", "gpu", variables=dict.fromkeys(PASSTHROUGH, ""))["services"]
    for name in SERVICES:
        env = container_env(unset[name])
        assert not set(PASSTHROUGH) & set(env), f"{name}: unset variables are not passed"
        assert set(PASSTHROUGH) <= set(container_env(empty[name]))
        for services in (unset, empty):
            settings = settings_from(container_env(services[name]), monkeypatch)
            for variable in PASSTHROUGH:
                field = variable.removeprefix("RAGSPEC_").lower()
                if field in Settings.model_fields:
                    assert getattr(settings, field) == getattr(defaults, field), f"{name}: {variable}"
        assert _volume(unset[name], "/models") == (str(REPO / "models"), True)  # ./models by default


@needs_compose
def test_dot_env_and_env_file_both_reach_the_containers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `.env` next to the compose file fills the passthrough variables (a JSON value as written); any other
    setting goes in the env_file (ragspec.env, or the file RAGSPEC_ENV_FILE names)."""
    shutil.copy(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    shutil.copy(ENV_FILE, tmp_path / "ragspec.env")
    (tmp_path / ".env").write_text(
        "RAGSPEC_TARGET_MODEL=/models/Qwen2.5-7B-Instruct\n"
        f"RAGSPEC_ROPE_SCALING={PASSTHROUGH['RAGSPEC_ROPE_SCALING']}\n"
        "RAGSPEC_MAX_CONTEXT=\n"
    )
    file = tmp_path / "docker-compose.yml"
    services = resolved("--profile", "gpu", file=file, project=tmp_path)["services"]
    for name in SERVICES:
        env = container_env(services[name])
        assert env["RAGSPEC_TARGET_MODEL"] == "/models/Qwen2.5-7B-Instruct"
        assert env["RAGSPEC_ROPE_SCALING"] == PASSTHROUGH["RAGSPEC_ROPE_SCALING"]
        settings = settings_from(env, monkeypatch)
        assert settings.rope_scaling is not None and settings.rope_scaling["factor"] == 4.0
        assert settings.max_context is None
        assert "RAGSPEC_RETRIEVAL_TOP_K" not in env  # the shipped env_file sets nothing

    mine = tmp_path / "mine.env"
    mine.write_text("RAGSPEC_RETRIEVAL_TOP_K=5\n")
    (tmp_path / "ragspec.env").write_text("RAGSPEC_CHUNK_TOKENS=256\n")
    default_file = resolved("--profile", "gpu", file=file, project=tmp_path)["services"]
    named_file = resolved("--profile", "gpu", file=file, project=tmp_path,
                          variables={"RAGSPEC_ENV_FILE": str(mine)})["services"]
    for name in SERVICES:
        assert container_env(default_file[name])["RAGSPEC_CHUNK_TOKENS"] == "256"
        assert container_env(named_file[name])["RAGSPEC_RETRIEVAL_TOP_K"] == "5"
        assert "RAGSPEC_CHUNK_TOKENS" not in container_env(named_file[name])


@needs_compose
def test_the_shipped_env_file_sets_nothing_the_environment_would_hide() -> None:
    """ragspec.env as shipped is all comments; the settings it shows are real and none of them is one that
    `environment` sets (that one would win over the file)."""
    lines = [line.strip() for line in ENV_FILE.read_text().splitlines() if line.strip()]
    assert all(line.startswith("#") for line in lines)
    shown = {m[1] for line in lines if (m := re.match(r"#\s*(RAGSPEC_[A-Z0-9_]+)=", line))}
    assert shown, "the file shows how a setting is written"
    fields = {f"RAGSPEC_{name.upper()}" for name in Settings.model_fields}
    assert shown <= fields
    services = resolved("--profile", "gpu")["services"]
    for name in SERVICES:
        assert not shown & set(services[name]["environment"]), name


@needs_compose
def test_big_models_get_a_longer_health_start_period() -> None:
    def seconds(text: str) -> float:
        units = {"s": 1, "m": 60, "h": 3600}
        return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)([smh])", str(text)))

    services = resolved("--profile", "gpu")["services"]
    cpu, gpu = (seconds(services[n]["healthcheck"]["start_period"]) for n in SERVICES)
    assert cpu == 180 and gpu == 600
    longer = resolved("--profile", "gpu", variables={"RAGSPEC_GPU_START_PERIOD": "1200s"})["services"]
    assert seconds(longer["ragspec-gpu"]["healthcheck"]["start_period"]) == 1200
    assert "/readyz" in " ".join(longer["ragspec-gpu"]["healthcheck"]["test"])  # the rest of the check kept


def test_the_cuda_image_can_load_with_device_map() -> None:
    """`pip install .` (both variants) brings accelerate, and the builder checks it imports."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"accelerate\b", dep) for dep in project["dependencies"])
    built = " ".join(rest for word, rest in dockerfile_instructions() if word == "RUN")
    assert re.search(r"pip install \.\s.*import accelerate", built)


def test_host_weights_stay_out_of_the_build_context_and_git() -> None:
    assert re.search(r"^/?models/?$", (REPO / ".dockerignore").read_text(), re.M)
    assert re.search(r"^/models/$", (REPO / ".gitignore").read_text(), re.M)
