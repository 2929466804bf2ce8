"""Server-sent events: framing and the response headers that keep proxies from buffering."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def frame(data: Any, event: str | None = None) -> str:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in payload.split("\n")) + "\n"


def comment(text: str) -> str:
    """An SSE comment frame (clients ignore it): progress for clients that know only their own events."""
    return "".join(f": {line}\n" for line in text.split("\n")) + "\n"


def sse_response(frames: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
