"""What the image and ``make test`` run, outside Docker: the routes and commands the image names exist
(``/healthz``, ``/readyz`` without a key, ``ragspec serve``, ``ragspec models``); ``ragspec kernels`` builds
the CPU kernels where a compiler is and the service loads them where none is (the Dockerfile's builder and
runtime stages); scripts/test-deps, ``make test``'s first step, installs what the tests need or fails at
once with one line, and ``make test`` stops there before anything slow.

The Dockerfile, docker-compose.yml and .dockerignore themselves are checked in tests/app/test_deploy.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.heavy  # among the longest modules: scheduled first (tests/conftest.py)

# ---- what the image runs --------------------------------------------------------------------------------


def test_health_route_and_cli_match_the_image() -> None:
    """What the image runs exists: `/healthz` and `/readyz` (its health check) answer without a key,
    `ragspec serve --host --port`, `ragspec models`."""
    from fastapi.testclient import TestClient

    from app.cli.main import build_parser
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings(api_keys=["k"]))  # type: ignore[call-arg]
    client = TestClient(app)  # not entered as a context: lifespan (model loading) does not run
    response = client.get("/healthz")  # no API key, although the service requires one
    assert response.status_code == 200 and response.json()["status"] == "ok"
    ready = client.get("/readyz")  # no key either: 503 until the models are loaded, never 401
    assert ready.status_code == 503 and ready.json()["checks"]["models"] == "not loaded"

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "8000"])
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert build_parser().parse_args(["models"]).command == "models"
    console = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert console["ragspec"] == "app.cli.main:main"


# ---- the image's kernels: built where a compiler is, loaded where none is -------------------------------


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the library (scripts/test-deps)")
def test_prebuilt_kernels_load_where_the_compiler_is_gone(tmp_path: Path) -> None:
    """What the two stages do: `ragspec kernels --all` with a named compiler and cache dir (builder: one library
    per ISA path, the configured one last), then the same settings with that compiler gone and none on the PATH
    (runtime): the service's kernel set-up loads the prebuilt library of this CPU's path; with an empty cache dir
    it fails loudly instead (the runtime stage's check)."""
    import torch

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the kernels need AVX2")
    venv_bin = Path(sys.executable).parent  # the virtualenv running the tests: its `ragspec` and python
    compiler = tmp_path / "bin" / "gcc"
    compiler.parent.mkdir()
    compiler.symlink_to(str(shutil.which("gcc")))
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO),  # this checkout's code
           "RAGSPEC_KERNEL_CACHE": str(tmp_path / "kernels"), "RAGSPEC_KERNEL_COMPILER": str(compiler)}
    built = subprocess.run([str(venv_bin / "ragspec"), "kernels", "--all"], capture_output=True, text=True, env=env,
                           timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    libraries = [Path(line) for line in built.stdout.strip().splitlines()]
    assert sorted(p.name.split("-")[1] for p in libraries) == ["amx", "avx2", "avx512"]  # every path, whatever this CPU
    library = libraries[-1]  # this CPU's (RAGSPEC_CPU_ISA auto)
    assert all(p.is_file() and p.parent == tmp_path / "kernels" for p in libraries)

    compiler.unlink()  # the runtime stage: no compiler at all
    runtime = (
        "import os, sys\n"
        "from app.cli.main import main\n"
        "from app.services import configure_kernels\n"
        "from app.settings import Settings\n"
        "from decoding.runtime import kernels\n"
        "configure_kernels(Settings())\n"
        "lib = kernels.load()\n"
        "print(lib._name if lib else 'NONE: ' + kernels.unavailable_reason())\n"
        "print('cli', main(['kernels']))  # the runtime stage's check: finds the library, compiles nothing\n"
        f"os.environ['RAGSPEC_KERNEL_CACHE'] = {str(tmp_path / 'empty')!r}\n"
        "print('cli, empty cache', main(['kernels']))\n"
    )
    run = subprocess.run([str(venv_bin / "python"), "-c", runtime], capture_output=True, text=True,
                         env={**env, "PATH": str(venv_bin)}, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [str(library), str(library), "cli 0", "cli, empty cache 1"], run.stderr


# ---- make test's first step: scripts/test-deps -----------------------------------------------------------

TEST_DEPS = REPO / "scripts" / "test-deps"
BASH = "/bin/bash"


def _stub(directory: Path, name: str, body: str = "exit 0") -> None:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _test_deps(path_dir: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    run = subprocess.run([BASH, str(TEST_DEPS)], capture_output=True, text=True, timeout=60,
                         env={"PATH": str(path_dir), "RAGSPEC_POSTGRES_BIN": str(path_dir / "none"), **env})
    return run, time.monotonic() - start


def test_test_deps_without_apt_get_prints_one_line_and_fails_fast(tmp_path: Path) -> None:
    run, took = _test_deps(tmp_path)  # an empty PATH: nothing found, no apt-get, no sudo
    assert run.returncode == 1 and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    for package in ("redis-server", "postgresql", "chromium", "gcc", "docker-compose"):
        assert package in lines[0]
    assert "apt-get install" in lines[0] and took < 10


def test_test_deps_passes_quietly_when_everything_is_there(tmp_path: Path) -> None:
    for name in ("redis-server", "initdb", "chromium", "cc", "docker-compose"):
        _stub(tmp_path, name)
    run, _ = _test_deps(tmp_path)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
    (tmp_path / "chromium").unlink()
    run, _ = _test_deps(tmp_path, RAGSPEC_INSTALL_TEST_DEPS="no")
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert "chromium" in run.stderr and "redis-server" not in run.stderr


def _fake_apt(tmp_path: Path, provides: str) -> Path:
    """An apt-get that logs its arguments and, on install, puts stubs of ``provides`` on the PATH; a sudo
    that runs its command (for a non-root test run)."""
    log = tmp_path / "apt.log"
    body = (f'echo "$*" >> {log}\n'
            f'[ "$1" = install ] || exit 0\n'
            f'for name in {provides}; do\n'
            f'  printf "#!/bin/sh\\n" > {tmp_path}/$name; /bin/chmod +x {tmp_path}/$name\n'
            'done')
    _stub(tmp_path, "apt-get", body)
    _stub(tmp_path, "sudo", '[ "$1" = -n ] && shift; exec "$@"')
    return log


def test_test_deps_installs_what_is_missing_when_it_may(tmp_path: Path) -> None:
    for name in ("initdb", "chromium", "cc", "docker-compose"):
        _stub(tmp_path, name)
    log = _fake_apt(tmp_path, "redis-server")
    run, _ = _test_deps(tmp_path)
    assert run.returncode == 0, run.stderr
    assert log.read_text().splitlines() == ["install -y -q redis-server"]
    assert (tmp_path / "redis-server").exists()


def test_test_deps_says_so_when_installing_did_not_help(tmp_path: Path) -> None:
    log = _fake_apt(tmp_path, "")  # installs nothing
    run, _ = _test_deps(tmp_path)
    assert run.returncode == 1
    assert "apt-get install failed" in run.stderr.splitlines()[-1]
    assert log.read_text().splitlines()[0].startswith("install -y -q redis-server postgresql chromium gcc libc6-dev")


def test_test_deps_never_installs_when_told_not_to(tmp_path: Path) -> None:
    log = _fake_apt(tmp_path, "redis-server chromium cc docker-compose")
    run, _ = _test_deps(tmp_path, RAGSPEC_INSTALL_TEST_DEPS="no")
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1
    assert not log.exists()


def test_make_test_stops_before_anything_slow(tmp_path: Path) -> None:
    """The README's command itself: with nothing installed and no way to install, `make test` ends in
    seconds with the one line, before a virtualenv is even made."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in (make, BASH):
        (bin_dir / Path(tool).name).symlink_to(tool)
    venv = tmp_path / "venv"
    start = time.monotonic()
    run = subprocess.run([make, "-C", str(REPO), "test", f"VENV={venv}"], capture_output=True, text=True,
                         env={"PATH": str(bin_dir), "HOME": str(tmp_path)}, timeout=120)
    assert run.returncode != 0 and time.monotonic() - start < 30
    assert "make test needs redis-server" in run.stderr
    assert not venv.exists()
