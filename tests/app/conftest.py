"""Fixtures of the service tests: one real server per test module (see tests/app/live.py), a client of it
and one indexed document.

A module sets its server's settings by overriding ``server_settings`` with its own module-scoped fixture
returning ``service_settings`` overrides; being a fixture, it can use others (a module's Redis server).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.app.live import LANDMARKS, ThreadServer, service_settings, thread_server, upload_text, wait_indexed


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    """Overrides of ``service_settings`` for the module's server: none unless the module says."""
    return {}


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, server_settings: dict[str, Any]
) -> Iterator[ThreadServer]:
    """One server for the whole module, with its own data dir: it loads the models once, not per test."""
    data_dir = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    with thread_server(service_settings(data_dir, **server_settings)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> Iterator[httpx.Client]:
    """A client of the module's server, without a key."""
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def doc(client: httpx.Client) -> str:
    """LANDMARKS uploaded to the module's server and indexed."""
    doc_id = upload_text(client, LANDMARKS, title="Landmarks")
    assert wait_indexed(client, doc_id)["status"] == "ready"
    return doc_id
