"""One HTTP request carried between processes as plain data, and played into an ASGI app on the other side.

The cluster's ingress receives a request, turns it into a ``WireRequest`` (a dict: method, path, query, headers,
body, client) and hands it to an engine replica, which runs its own copy of the one-process app on it
(``play``): the response comes back as a stream of items, first ``{"status", "headers", "replica"}``, then the
body's byte chunks as the app sends them (SSE frames one by one), and ``ABORTED`` if the app failed after its
answer began (the ingress then cuts the connection, as uvicorn would, rather than end a truncated answer cleanly).
So every route, error, auth and tenancy rule behaves in a cluster exactly as in one process: the same app answers.
When the caller stops reading (the client went away), the app sees ``http.disconnect`` as under uvicorn and cancels
its generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypedDict

logger = logging.getLogger(__name__)

DISCONNECT_GRACE_S = 5.0  # after a disconnect, how long the app may take to wind its generation down

# not forwarded: they describe one connection, not the request
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                        "proxy-authorization", "proxy-connection"})


ABORTED = {"aborted": True}


class WireRequest(TypedDict):
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    client: tuple[str, int] | None


def wire_request(method: str, path: str, query: str, headers: Mapping[str, str] | list[tuple[str, str]],
                 body: bytes, client: tuple[str, int] | None) -> WireRequest:
    items = headers.items() if isinstance(headers, Mapping) else headers
    kept = [(k.lower(), v) for k, v in items if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"]
    if body:  # the body as it arrives, whole: its real length (a chunked request had none)
        kept.append(("content-length", str(len(body))))
    return WireRequest(method=method.upper(), path=path, query=query, headers=kept, body=body, client=client)


def _scope(request: WireRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": request["path"],
        "raw_path": request["path"].encode(),
        "query_string": request["query"].encode("latin-1"),
        "root_path": "",
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
        "client": request["client"],
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def play(app: Any, request: WireRequest, replica: str) -> AsyncIterator[Any]:
    """Run ``request`` through the ASGI ``app``; yield the response head, then its body chunks as they are sent."""
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    failed = False

    async def run() -> None:
        nonlocal failed
        try:
            await app(_scope(request), receive, send)
        except Exception:  # the app's error middleware has answered 500 when it could
            failed = True
            logger.exception("%s %s failed on replica %s", request["method"], request["path"], replica)
        finally:
            await out.put(None)

    task = asyncio.create_task(run())
    try:
        started = complete = False
        while (message := await out.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())]
                yield {"status": int(message["status"]), "headers": headers, "replica": replica}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    complete = True
                    break
        if started and not complete and failed:
            yield ABORTED
        elif not started:  # the app failed before it answered
            yield {"status": 500, "headers": [("content-type", "application/json")], "replica": replica}
            yield b'{"error":{"code":"internal_error","message":"the replica failed to answer"}}'
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            task.cancel()
