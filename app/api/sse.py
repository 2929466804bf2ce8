"""Server-sent events through sse-starlette: the framing, keep-alive pings and client disconnects.

Pings are comment frames sent every ``ping_s`` seconds from the moment the response starts, whatever the
stream is waiting for (retrieval, a place in the generation queue, the prefill), so a reverse proxy with a
read timeout never closes a stream whose first token is slow; every SSE client skips comments. A client
that goes away cancels the stream's generator (sse-starlette listens for ``http.disconnect``), and the
generator's ``finally`` cancels the generation.

At a shutdown signal sse-starlette would cut every open stream at once; that is turned off, so uvicorn
drains streams as it drains every other request and an answer under way still ends with its ``done``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus

SEP = "\n"  # one separator for events and pings: the smallest frames, and what our own tests read
NO_CACHE = {"Cache-Control": "no-cache"}

AppStatus.disable_automatic_graceful_drain()


def frame(data: Any, event: str | None = None) -> ServerSentEvent:
    """One SSE event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return ServerSentEvent(payload, event=event, sep=SEP)


def comment(text: str) -> ServerSentEvent:
    """A comment frame (clients ignore it): a heartbeat, or progress for clients that know only their own
    events."""
    return ServerSentEvent(comment=text, sep=SEP)


def encode(event: ServerSentEvent) -> str:
    """The frame's text as it goes on the wire."""
    return event.encode().decode("utf-8")


def sse_response(events: AsyncIterator[ServerSentEvent], ping_s: float) -> EventSourceResponse:
    """A text/event-stream of ``events`` with a ``: ping`` comment every ``ping_s`` seconds."""
    return EventSourceResponse(
        events, ping=ping_s, sep=SEP, headers=NO_CACHE, ping_message_factory=lambda: comment("ping")
    )
