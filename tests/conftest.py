"""Shared fixtures and helpers: a real redis-server and a real PostgreSQL on free loopback ports, the bundled model
assets, PDFs, an embedder that counts its calls."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from decoding.runtime import bundled as assets
from retrieval.embedding import Embedder

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("RAGSPEC_DATA_DIR", REPO / "data"))
BUNDLED_GGUF_DIR = assets.bundled_gguf_dir(DATA_DIR / "models")  # what the service serves on a CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def start(self) -> None:
        """(Re)start on the same port, with the same data dir (so RDB persistence is kept)."""
        self.stop()
        self.proc = _spawn_redis(self.port, self.workdir)


def _spawn_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server); .ci/run installs it")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"redis-server did not start on port {port}")


@contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, killed on exit."""
    port = free_port()
    server = RedisServer(port=port, proc=_spawn_redis(port, workdir), workdir=workdir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh real redis-server per test."""
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for a whole module: for a module-scoped service that outlives each test."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@dataclass
class PostgresServer:
    port: int
    proc: subprocess.Popen[bytes]
    datadir: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://ragspec@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A fresh database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def postgres_binary(name: str) -> str:
    """Debian keeps PostgreSQL's programs off PATH (``/usr/lib/postgresql/<version>/bin``)."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        pytest.fail("PostgreSQL is not installed (apt-get install postgresql); make test's dependency check does it")
    return found


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: there, its programs run as the ``postgres`` user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL (a fresh cluster: trust auth, loopback only, fsync off) on a free port, stopped on exit."""
    datadir = Path(tempfile.mkdtemp(prefix="ragspec-pg-"))  # not under pytest's root-only tmp: postgres reads it
    if os.geteuid() == 0:
        shutil.chown(datadir, "postgres", "postgres")
    init = subprocess.run(_as_postgres([postgres_binary("initdb"), "-D", str(datadir / "db"), "-U", "ragspec",
                                        "--auth=trust", "--no-sync", "-E", "UTF8"]),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if init.returncode != 0:
        pytest.fail(f"initdb failed: {init.stderr[-2000:]}")
    port = free_port()
    proc = subprocess.Popen(
        _as_postgres([postgres_binary("postgres"), "-D", str(datadir / "db"), "-p", str(port), "-k", str(datadir),
                      "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    server = PostgresServer(port=port, proc=proc, datadir=datadir)
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run([postgres_binary("pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                                   capture_output=True, timeout=10)  # fmt: skip
            if probe.returncode == 0:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"PostgreSQL did not start on port {port}")
            time.sleep(0.1)
        yield server
    finally:
        subprocess.run(_as_postgres([postgres_binary("pg_ctl"), "stop", "-D", str(datadir / "db"), "-m", "immediate"]),
                       capture_output=True, timeout=60)  # fmt: skip
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(datadir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    """One real PostgreSQL for a whole module (each test makes its own database)."""
    with running_postgres() as server:
        yield server


@pytest.fixture(scope="session")
def bundled_gguf_dir() -> Path:
    """The bundled SmolLM2 GGUF dir (`ragspec models` makes it; `make test` runs that first)."""
    from decoding.runtime.bundled import has_gguf_dir

    if not has_gguf_dir(BUNDLED_GGUF_DIR):
        pytest.fail(f"{BUNDLED_GGUF_DIR} missing: run `ragspec models` (make test does)")
    return BUNDLED_GGUF_DIR


def make_pdf(pages: list[str], title: str | None = None) -> bytes:
    """A PDF with one page per string (an empty string: a page without text)."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    if title:
        pdf.set_title(title)
    for text in pages:
        pdf.add_page()
        if text:
            pdf.multi_cell(0, 8, text)
    return bytes(pdf.output())


class CountingEmbedder:
    """An embedder that counts its calls (every call is a forward of the embedding model)."""

    def __init__(self, inner: Embedder) -> None:
        self.inner, self.name, self.dim = inner, inner.name, inner.dim
        self.calls: list[list[str]] = []

    def encode(self, texts: Sequence[str], batch_size: int = 32, progress: Any = None) -> np.ndarray:
        self.calls.append(list(texts))
        return self.inner.encode(texts, batch_size, progress)

    def encode_query(self, text: str) -> np.ndarray:
        self.calls.append([text])
        return self.inner.encode_query(text)


def pytest_configure(config: pytest.Config) -> None:
    """Under ``-n N --dist loadfile`` the files go to the workers in the order below (``heavy`` first): pytest-xdist's
    default (since 3.6) would reorder them by their number of tests, and start a long module of few tests last."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules marked ``heavy`` first (the order otherwise kept): with the suite spread over workers a file at a
    time, a long module that started last would leave one worker running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
