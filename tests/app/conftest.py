"""Fixtures of the service tests: one real server per test module (see tests/app/live.py), a client of it
and one indexed document; the models every in-process server loads are loaded once per test session.

A module sets its server's settings by overriding ``server_settings`` with its own module-scoped fixture
returning ``service_settings`` overrides; being a fixture, it can use others (a module's Redis server).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

import app.services
from app.settings import Settings
from decoding.runtime.bundled import BUNDLED
from decoding.runtime.loader import LoadedModel
from retrieval.embedding import Embedder
from tests.app.live import LANDMARKS, ThreadServer, service_settings, thread_server, upload_text, wait_indexed


@pytest.fixture(scope="session", autouse=True)
def shared_models() -> Iterator[None]:
    """Every in-process server (and ``load_services`` call) of the session reuses the target / drafter LMs and
    embedders already loaded with the same options: a load takes seconds, and a loaded model keeps no request
    state (each server has its own engine, caches, store and queue). Loading itself is tested in tests/decoding
    and by the subprocess servers."""
    load_llm, load_embedder = app.services.load_llm, app.services.load_embedder
    models: dict[str, LoadedModel] = {}
    embedders: dict[tuple[str, str, str], Embedder] = {}

    def shared_llm(settings: Settings, spec: str, rope_scaling: dict[str, Any] | None = None) -> LoadedModel:
        # the models dir (by default under each server's own data dir) only says where "bundled" is: a model named
        # by its path is the same model whatever it is, and loaded once for every module's server
        models_dir = settings.models_dir if spec == BUNDLED else None
        options = (spec, rope_scaling, models_dir, settings.device, settings.dtype, settings.cpu_kernels,
                   settings.cpu_quant, settings.kv_dtype, settings.kernel_cache, settings.kernel_compiler)
        key = json.dumps(options, sort_keys=True, default=str)
        if key not in models:
            models[key] = load_llm(settings, spec, rope_scaling)
        else:
            app.services.configure_kernels(settings)
            if settings.threads is not None:
                torch.set_num_threads(settings.threads)
        return models[key]

    def shared_embedder(name: str, kind: Any = "auto", device: str = "auto") -> Embedder:
        if (name, kind, device) not in embedders:
            embedders[name, kind, device] = load_embedder(name, kind, device)
        return embedders[name, kind, device]

    app.services.load_llm, app.services.load_embedder = shared_llm, shared_embedder  # type: ignore[assignment]
    try:
        yield
    finally:
        app.services.load_llm, app.services.load_embedder = load_llm, load_embedder


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
