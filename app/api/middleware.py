"""The front gate: API keys and body size are checked before a request's body is read.

FastAPI reads and parses a JSON body before any dependency runs, so a key checked in a dependency comes
after the body has been buffered: an anonymous client could make the service hold any amount of memory.
This pure ASGI middleware answers 401 from the headers alone, and bounds the body of every route but the
upload route (which streams its body under the upload limit itself): 413 from ``Content-Length`` before
reading, or as soon as a body without one (chunked) grows past the limit. A body within the limit is read
here and handed on unchanged; nothing above the limit is ever held.

It also records who is asking in the scope (``TENANT``; ``METRICS_VIEW`` for ``/metrics``) for the metrics
middleware and the metrics route.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import Unauthorized, error_body
from app.serving.auth import KeyRing
from app.serving.metrics import Metrics

logger = logging.getLogger(__name__)

TENANT = "ragspec.tenant"  # scope key: the caller's tenant ("none" when refused before one was known)
METRICS_VIEW = "ragspec.metrics_view"  # scope key on /metrics: "total", "all" or "tenant"
NO_TENANT = "none"
ARRIVED = "ragspec.arrived"  # scope key: time.perf_counter() when the request reached the app (ttft counts from it)

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/", "/docs"})  # no key needed (no tenant data)
PUBLIC_PREFIXES = ("/static/",)
STREAMED_UPLOADS = frozenset({("POST", "/v1/documents"), ("POST", "/v1/files")})  # routes bounding their bodies


@dataclass(frozen=True)
class GatePolicy:
    keys: KeyRing
    metrics_token: str | None
    max_body_bytes: int


class RequestGate:
    """Pure ASGI middleware: 401 / 413 from the headers (or the first bytes over the limit), before the app
    and before the body; streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, policy: GatePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[TENANT] = NO_TENANT
        path: str = scope["path"]
        headers = _headers(scope)
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            if not self.policy.keys.enabled:
                scope[TENANT] = self.policy.keys.tenant(None)
        else:
            refused = self._admit(scope, path, _bearer(headers.get("authorization")))
            if refused is not None:
                client = scope.get("client")
                logger.info("refused %s %s from %s: %s", scope["method"], path, client[0] if client else "?",
                            refused.message)
                await _reply(send, refused.status, refused.code, refused.message, refused.headers)
                return
        if (scope["method"], path) in STREAMED_UPLOADS or not _has_body(headers):
            await self.app(scope, receive, send)
            return
        limit = self.policy.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(send, f"the request body is {int(declared)} bytes; the limit is {limit} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the body was complete
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(send, f"the request body exceeds the limit of {limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _admit(self, scope: Scope, path: str, token: str | None) -> Unauthorized | None:
        """Record the caller's tenant (and metrics view) in ``scope``; the error when it may not pass."""
        keys = self.policy.keys
        if path == "/metrics":
            scope[METRICS_VIEW] = "total"
            if not keys.enabled:
                scope[TENANT] = keys.tenant(None)
                return None
            if self.policy.metrics_token and token and keys.same(token, self.policy.metrics_token):
                scope[METRICS_VIEW] = "all"
                return None
            scope[METRICS_VIEW] = "tenant"
        try:
            scope[TENANT] = keys.tenant(token)
        except Unauthorized as exc:
            return exc
        return None


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _has_body(headers: dict[str, str]) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0") not in ("", "0")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` once, then whatever the client sends next (its disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _too_large(send: Send, message: str) -> None:
    await _reply(send, 413, "payload_too_large", message, {})


async def _reply(send: Send, status: int, code: str, message: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_body(code, message)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequestMetricsMiddleware:
    """Pure ASGI middleware (keeps streaming and disconnects intact): counts and times every request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = scope[ARRIVED] = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or (
                "static" if scope["path"].startswith("/static") else "unmatched"
            )
            tenant = str(scope.get(TENANT, NO_TENANT))
            self.metrics.requests.labels(tenant, path, scope["method"], str(status)).inc()
            self.metrics.latency.labels(tenant, path).observe(time.perf_counter() - t0)
