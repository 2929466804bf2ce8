"""Upload bodies read under their limits, for the routes that take files (``/v1/documents``, ``/v1/files``): a body
whose declared or arriving size passes the limit is refused with 413 while it is read, never buffered whole."""

from __future__ import annotations

from fastapi import Request
from starlette.types import Message

from app.errors import PayloadTooLarge

MULTIPART_SLACK = 64 * 1024  # headers and boundaries around a file part (a field part is at most this)
MULTIPART_FIELDS = 8  # title, collection_id, attributes (and room for a client's extra field or two)


async def read_limited(request: Request, limit: int) -> Request:
    """A view of ``request`` whose body raises ``PayloadTooLarge`` once more than ``limit`` bytes arrive
    (checked while reading: an oversized upload is never buffered whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the upload is {int(declared)} bytes; the limit is {limit} bytes")
    seen = 0

    async def receive() -> Message:
        nonlocal seen
        message = await request.receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge(f"the upload exceeds the limit of {limit} bytes")
        return message

    return Request(request.scope, receive)


def _boundary(content_type: str) -> bytes | None:
    for param in content_type.split(";")[1:]:
        name, _, value = param.strip().partition("=")
        if name.strip().lower() == "boundary" and value.strip().strip('"'):
            return value.strip().strip('"').encode("latin-1", "replace")
    return None


async def read_limited_parts(request: Request, part_limit: int, max_parts: int) -> Request:
    """A view of a multipart ``request`` whose body may hold at most ``part_limit`` bytes per part begun so far
    (parts counted by their delimiters as the bytes arrive, at most ``max_parts``): ``PayloadTooLarge`` as soon
    as it holds more, so one oversized file is refused while it is read, never buffered whole, and a request of
    many files may carry the sum of their limits."""
    overall = part_limit * max_parts
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > overall:
        raise PayloadTooLarge(f"the upload is {int(declared)} bytes; the limit is {overall} bytes "
                              f"({max_parts} parts of at most {part_limit} bytes)")
    boundary = _boundary(request.headers.get("content-type", ""))
    delimiter = b"--" + boundary if boundary else None
    seen = parts = 0
    tail = b""

    async def receive() -> Message:
        nonlocal seen, parts, tail
        message = await request.receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            seen += len(chunk)
            if delimiter is not None and chunk:
                window = tail + chunk  # a delimiter split across two chunks is counted once
                parts += window.count(delimiter)
                tail = window[-(len(delimiter) - 1):] if len(delimiter) > 1 else b""
            if seen > max(1, min(parts, max_parts)) * part_limit:
                raise PayloadTooLarge(f"the upload exceeds the limit of {part_limit - MULTIPART_SLACK} bytes per "
                                      "file")
        return message

    return Request(request.scope, receive)
