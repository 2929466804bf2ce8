"""Real servers for the service tests: uvicorn on a free loopback port, in a thread or a subprocess.
A test module's usual server is the ``server`` fixture of tests/app/conftest.py, built from these.

Every server uses the bundled SmolLM2 target (its GGUF dir under the repo's data dir), the bundled MiniLM
embedder and its own temporary data dir. Deadlines below bound "it never happened" waits (a stuck job,
a server that never starts); they are not speed assertions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from app.main import create_app
from app.services import Services
from app.settings import Settings
from tests.conftest import BUNDLED_GGUF_DIR, REPO, free_port

DEADLINE_S = 300.0


def service_settings(data_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "target_model": str(BUNDLED_GGUF_DIR),
        "threads": 1,
        "calibrate": False,
        "default_max_tokens": 12,
        "max_new_tokens": 64,
        "queue_size": 4,
        "max_context": 1024,  # long-document tests stay small on a CPU
    }
    values.update(overrides)
    return Settings(**values)


def wait_for(predicate: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S, every_s: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(every_s)


class Live:
    """What a test needs of a running server: its URL and HTTP clients."""

    url: str

    def client(self, key: str | None = None, timeout: float = DEADLINE_S) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


class ThreadServer(Live):
    """``create_app(settings)`` under uvicorn in a thread of the test process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(settings)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=10
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), "the server to start")
        if not self.server.started:
            raise RuntimeError("the server failed to start (see the log)")

    @property
    def services(self) -> Services:
        """The running app's loaded services (in-process only)."""
        services: Services = self.app.state.services
        return services

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@contextmanager
def thread_server(settings: Settings) -> Iterator[ThreadServer]:
    server = ThreadServer(settings)
    try:
        yield server
    finally:
        server.stop()


class ProcessServer(Live):
    """``uvicorn --factory app.main:create_app`` in a subprocess (so a test can kill it hard)."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "app.main:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._up, "the server subprocess to start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log_path}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            return True
        try:
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """Like a crash or a power cut: no shutdown code runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def process_env(settings: Settings) -> dict[str, str]:
    """RAGSPEC_* environment equivalent to ``settings`` (for a subprocess server)."""
    env = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(value)
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[f"RAGSPEC_{name.upper()}"] = str(value)
    return env


# ---- API helpers ------------------------------------------------------------------------------------


def upload_text(client: httpx.Client, text: str, title: str | None = None) -> str:
    body: dict[str, Any] = {"text": text}
    if title is not None:
        body["title"] = title
    response = client.post("/v1/documents", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_indexed(client: httpx.Client, doc_id: str) -> dict[str, Any]:
    """Poll until the document leaves queued / indexing; return its final record."""

    def done() -> dict[str, Any] | None:
        record = client.get(f"/v1/documents/{doc_id}").json()
        return None if record["status"] in ("queued", "indexing") else record

    return dict(wait_for(done, f"document {doc_id} to be indexed"))


def ask(client: httpx.Client, **body: Any) -> httpx.Response:
    """POST /v1/ask with ``body``: a short answer (12 tokens) unless it names max_tokens."""
    body.setdefault("max_tokens", 12)
    return client.post("/v1/ask", json=body)


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """The value of one sample in /metrics (0.0 when absent)."""
    text = client.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        sample, _, rest = series.partition("{")
        if sample != name:
            continue
        got = ",".join(sorted(p for p in rest.rstrip("}").split(",") if p)) if rest else ""
        if got == want:
            return float(value)
    return 0.0


# a text whose follow-up question ("And when was it automated?") names no subject: citations, follow-ups
LIGHTHOUSE = (
    "The Lighthouse of Varnholm\n\n"
    "The lighthouse of Varnholm was built in 1872 by the engineer Ada Kessling. Its lamp burned whale oil "
    "until 1911, when it was converted to paraffin. The keeper, Tomas Brenner, kept the light for forty "
    "years and recorded every storm in a green logbook.\n\n"
    "In 1953 the lighthouse was automated, and the keeper's cottage became a small museum. The museum "
    "shows the green logbook, the original brass lens and a model of the island.\n"
)

LANDMARKS = (
    "The Eiffel Tower stands in Paris. It was completed in 1889 and is 330 metres tall.\n\n"
    "The Colosseum is an amphitheatre in Rome. Its construction began under the emperor Vespasian in 72 AD.\n\n"
    "The Great Wall of China is more than 21,000 kilometres long."
)


@contextmanager
def engine_held(services: Services) -> Iterator[threading.Event]:
    """The scheduler's slot taken by a job that runs until the yielded event is set (or the block ends): with
    ``max_batch`` 1 every answer asked meanwhile waits in the queue."""
    gate, started = threading.Event(), threading.Event()

    def run(cancel: threading.Event) -> Iterator[str]:
        started.set()
        while not gate.wait(0.01) and not cancel.is_set():
            pass
        yield "released"

    async def hold() -> None:
        async for _ in services.scheduler.submit(run).events():
            pass

    holder = threading.Thread(target=asyncio.run, args=(hold(),), name="engine-holder")
    holder.start()
    try:
        assert started.wait(DEADLINE_S), "the holding job never started"
        yield gate
    finally:
        gate.set()
        holder.join(DEADLINE_S)


def openai_refused(call: Callable[[], Any], status: int, param: str | None = None) -> dict[str, Any]:
    """The OpenAI client call's error: its status, and the body in OpenAI's shape (``param`` the field named, when
    given; ``type`` by who is at fault)."""
    import openai
    import pytest

    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status, info.value.body
    error = info.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param, error
    return error
