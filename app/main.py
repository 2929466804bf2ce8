"""The FastAPI application: ``create_app(settings)``; models and stores are loaded once in its lifespan (or
before, by ``ragspec serve``, which hands them to the app so that a start-up failure is one line:
``app.cli.startup``).

The settings are turned into the service's frozen config and its one key ring here, once: the request gate and the
loaded services share both. Run with ``ragspec serve`` (``serve_config``: the app built from the command's settings,
forwarded headers only from ``RAGSPEC_TRUSTED_PROXIES``), or ``uvicorn --factory app.main:create_app
--no-proxy-headers`` (settings from the environment; uvicorn alone trusts X-Forwarded-* from loopback).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import fastapi_offline
import uvicorn
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from app.api.deps import TenantDep
from app.api.middleware import GatePolicy, RequestGate, RequestMetricsMiddleware
from app.api.routes import (
    ask,
    capabilities,
    collections,
    documents,
    files,
    health,
    openai,
    responses,
    sessions,
    vector_stores,
)
from app.config import ServiceConfig
from app.errors import install_error_handlers
from app.services import Services, load_services
from app.serving.auth import KeyRing
from app.serving.metrics import Metrics
from app.settings import Settings

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
# Swagger UI's JS and CSS as the fastapi-offline package ships them: /docs needs no CDN
SWAGGER_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"


def _lifespan(settings: Settings, config: ServiceConfig, keys: KeyRing,
              metrics: Metrics) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the services loaded from ``settings`` with the app's own config, key ring and metrics
    (or those ``ragspec serve`` loaded already, app.cli.startup), on ``app.state.services`` while it runs (the
    settings stay here, out of the running app's reach)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services: Services | None = app.state.services
        if services is None:
            services = await asyncio.to_thread(load_services, settings, metrics, config=config, keys=keys)
        # what start-up loaded (models, tokenizers, indexes) lives as long as the process: out of the collector's
        # sight, its full passes stop rescanning it while generations run
        gc.collect()
        gc.freeze()
        services.redis.start_monitor()
        app.state.services = services
        try:
            yield
        finally:
            app.state.services = None
            await services.redis.close()
            await asyncio.to_thread(services.close)

    return lifespan


def _live(app: FastAPI) -> Mapping[str, Any]:
    services: Services | None = getattr(app.state, "services", None)
    if services is None:
        return {
            "queue_waiting": 0,
            "generations_running": 0,
            "kv_cache_bytes": 0,
            "kv_cache_hits": 0,
            "kv_cache_misses": 0,
            "indexing_jobs": {},
            "redis_up": None,
        }
    return services.live_metrics()


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    """The app of ``settings`` (default: from the environment). ``services``: loaded already from these settings
    (``ragspec serve`` loads them before it listens, app.cli.startup): the app takes their config, key ring and
    metrics, and its lifespan loads nothing."""
    settings = settings or Settings()  # type: ignore[call-arg]  # fields come from the environment
    if services is not None:
        config, keys, metrics = services.config, services.keys, services.metrics
    else:
        config = ServiceConfig.from_settings(settings)
        keys = KeyRing(config.access.api_keys)  # the gate's and the routes' (``services.keys``)
        metrics = Metrics()
    app = FastAPI(
        title="ragspec",
        version="0.1.0",
        summary="Long-context RAG question answering with lossless speculative decoding",
        lifespan=_lifespan(settings, config, keys, metrics),
        openapi_url=None,  # served below, behind the API key like every other route but /healthz
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = services
    metrics.add_live(lambda: _live(app))
    policy = GatePolicy(
        keys=keys,
        metrics_token=config.access.metrics_token,
        max_body_bytes=config.limits.max_json_bytes,
    )
    app.add_middleware(RequestGate, policy=policy)  # inside the metrics middleware: refusals are counted
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    install_error_handlers(app)

    for module in (health, documents, collections, ask, capabilities, sessions, openai, files, vector_stores,
                   responses):
        app.include_router(module.router)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema(tenant: TenantDep) -> JSONResponse:
        return JSONResponse(app.openapi())

    # /docs is public and holds no data: its script asks for /openapi.json with the API key the page keeps
    # (entered there or on the main page), and adds it to the requests "Try it out" sends
    @app.get("/docs", include_in_schema=False)
    async def docs() -> FileResponse:
        return FileResponse(STATIC_DIR / "docs.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static/swagger", StaticFiles(directory=SWAGGER_DIR), name="swagger")  # before /static
    if (STATIC_DIR / "index.html").exists():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

        @app.get("/", include_in_schema=False)
        async def page() -> FileResponse:
            return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    return app


def serve_config(settings: Settings, host: str, port: int, app: FastAPI | None = None) -> uvicorn.Config:
    """The uvicorn config of ``ragspec serve``: ``app`` (one made with its services loaded already, app.cli.startup),
    else the app built from ``settings`` (the command's, flags included); X-Forwarded-For / -Proto honoured only from
    the addresses in ``settings.trusted_proxies`` (none by default, so a client cannot forge its address)."""
    trusted = ",".join(settings.trusted_proxies)
    return uvicorn.Config(
        create_app(settings) if app is None else app,
        host=host,
        port=port,
        log_level=settings.log_level.lower(),
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
    )
