"""``ragspec`` subcommands that talk to a running server over HTTP (plugged into ``app.cli.main`` through
``app.cli.local``): ``ingest --url`` (upload, with its collection and attributes, then follow the indexing
progress until ready or failed), ``list``, ``delete`` and ``ask --url``.

The server is ``--url``, else ``http://RAGSPEC_HOST:RAGSPEC_PORT`` (``http://127.0.0.1:8000`` by default; a
wildcard bind address is reached on loopback). A server that cannot be reached is one line on stderr and
exit code 1, never a traceback; an error answer is its status, code and message on stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import mimetypes
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TextIO

from app.cli.progress import ACTIVE, ProgressLine

if TYPE_CHECKING:
    import httpx

SubParsers = Any
P = ParamSpec("P")
POLL_S = 0.25  # how often a followed document is polled (a server-side row update per embedding batch)
WILDCARDS = ("", "0.0.0.0", "::")


class ServerAddress(Protocol):
    """Where the local server listens, the default of ``--url``: all these commands read of the settings
    (the command's ``Settings`` is one)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class Unreachable(Exception):  # noqa: N818 (reads as the condition it reports)
    """The server did not answer (refused, timed out, bad URL): reported as one line."""


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def warn(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def server_url(args: argparse.Namespace, settings: ServerAddress) -> str:
    """``--url``, else the local server of the settings (a wildcard bind address becomes loopback)."""
    if args.url:
        return str(args.url).rstrip("/")
    host = "127.0.0.1" if settings.host in WILDCARDS else settings.host
    return f"http://[{host}]:{settings.port}" if ":" in host else f"http://{host}:{settings.port}"


def add_server_options(p: argparse.ArgumentParser, *, required_url: bool = False) -> None:
    p.add_argument(
        "--url", default=None, required=required_url,
        help="base URL of the server (default: http://RAGSPEC_HOST:RAGSPEC_PORT, i.e. http://127.0.0.1:8000)",
    )
    p.add_argument("--api-key", default=None, help="Bearer key, when the server uses RAGSPEC_API_KEYS")


@contextmanager
def http_client(url: str, api_key: str | None, timeout_s: float = 600.0) -> Iterator[httpx.Client]:
    """A client of ``url``; transport failures inside the block become :class:`Unreachable`."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
            yield client
    except httpx.TransportError as exc:
        raise Unreachable(f"cannot reach the server at {url} ({_reason(exc)})") from None
    except httpx.InvalidURL as exc:
        raise Unreachable(f"bad server URL {url!r} ({exc})") from None


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "refused" in text.lower():
        return "connection refused: is `ragspec serve` running there?"
    return text


def handled(command: Callable[P, int]) -> Callable[P, int]:
    """``command`` with an unreachable server reported as one line on stderr (exit code 1)."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except Unreachable as exc:
            warn(f"ragspec: {exc}")
            return 1

    return run


def error_text(response: httpx.Response) -> str:
    """``HTTP 404 not_found: ...`` from the service's ``{"error": {"code", "message"}}`` body."""
    try:
        error = response.json().get("error", {})
        detail = f"{error['code']}: {error['message']}"
    except (ValueError, AttributeError, KeyError, TypeError):
        detail = response.text.strip()[:300] or response.reason_phrase
    hint = " (give --api-key)" if response.status_code == 401 else ""
    return f"HTTP {response.status_code} {detail}{hint}"


def _detail(doc: dict[str, Any]) -> str:
    """What a document's line ends with: its size once ready, its stage while indexing, the failure."""
    if doc["status"] == "ready":
        return f"{doc.get('chunks') or 0} chunks, {doc.get('tokens') or 0} tokens"
    if doc["status"] == "indexing":
        stage = f" {doc['message']}" if doc.get("message") else ""
        return f"{round(100 * float(doc['progress']))}%{stage}"
    return str(doc.get("message") or "")


# ---- ingest --url ---------------------------------------------------------------------------------


def follow(client: httpx.Client, doc_id: str, name: str, out: TextIO, poll_s: float = POLL_S) -> dict[str, Any]:
    """Poll the document until it is ready or failed, writing its progress to ``out`` whenever it moves
    (``app.cli.progress``: on a terminal one line rewritten in place, else one line per change); returns the
    last record."""
    line = ProgressLine(name, out)
    while True:
        response = client.get(f"/v1/documents/{doc_id}")
        if response.status_code != 200:
            line.close()
            return {"id": doc_id, "status": "failed", "message": error_text(response)}
        doc: dict[str, Any] = response.json()
        line.show(doc["status"], float(doc["progress"]), doc.get("message"))
        if doc["status"] not in ACTIVE:
            line.close()
            return doc
        time.sleep(poll_s)


def _upload_fields(args: argparse.Namespace) -> dict[str, str]:
    """The multipart fields beside the file: ``title``, ``collection_id``, ``attributes`` (a JSON string)."""
    fields = {"title": args.title} if args.title else {}
    if getattr(args, "collection", None):
        fields["collection_id"] = args.collection
    if getattr(args, "attribute", None):
        fields["attributes"] = json.dumps(dict(args.attribute))
    return fields


def _error_code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


@handled
def ingest_http(args: argparse.Namespace, settings: ServerAddress) -> int:
    """Upload every file, then follow each until ready or failed; stdout: ``id, status, file, detail``."""
    url = server_url(args, settings)
    failures = 0
    uploaded: list[tuple[str, Path]] = []
    with http_client(url, args.api_key) as client:
        for path in map(Path, args.files):
            try:
                data = path.read_bytes()
            except OSError as exc:
                failures += 1
                warn(f"{path}: {exc.strerror or exc}")
                continue
            content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            response = client.post("/v1/documents", files={"file": (path.name, data, content_type)},
                                   data=_upload_fields(args) or None)
            if response.status_code != 202:
                failures += 1
                warn(f"{path}: {error_text(response)}")
                if response.status_code == 401 or _error_code(response) == "collection_not_found":
                    break  # every other file would be refused the same way
                continue
            uploaded.append((str(response.json()["id"]), path))
        for doc_id, path in uploaded:
            queued: dict[str, Any] = {"status": "queued", "progress": 0.0}
            doc = queued if args.no_wait else follow(client, doc_id, path.name, sys.stderr)
            failures += doc["status"] == "failed"
            say(f"{doc_id}\t{doc['status']}\t{path}\t{_detail(doc)}".rstrip("\t"))
    return 1 if failures else 0


# ---- list / delete --------------------------------------------------------------------------------


@handled
def list_documents(args: argparse.Namespace, settings: ServerAddress) -> int:
    with http_client(server_url(args, settings), args.api_key, timeout_s=60.0) as client:
        response = client.get("/v1/documents")
    if response.status_code != 200:
        warn(error_text(response))
        return 1
    body = response.json()
    if args.json:
        say(json.dumps(body, indent=2, ensure_ascii=False))
        return 0
    for doc in body["documents"]:
        say(f"{doc['id']}\t{doc['status']}\t{doc['title']}\t{_detail(doc)}".rstrip("\t"))
    return 0


def add_list(sub: SubParsers) -> None:
    p = sub.add_parser("list", help="list a server's documents (id, status, title, detail)")
    add_server_options(p)
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.set_defaults(handler=list_documents)


@handled
def delete_documents(args: argparse.Namespace, settings: ServerAddress) -> int:
    failures = 0
    with http_client(server_url(args, settings), args.api_key, timeout_s=60.0) as client:
        for doc_id in args.ids:
            response = client.delete(f"/v1/documents/{doc_id}")
            if response.status_code == 204:
                say(f"{doc_id}\tdeleted")
            else:
                failures += 1
                warn(f"{doc_id}: {error_text(response)}")
    return 1 if failures else 0


def add_delete(sub: SubParsers) -> None:
    p = sub.add_parser("delete", help="delete documents from a server (files, index and cached KV)")
    p.add_argument("ids", nargs="+", metavar="ID", help="document ids")
    add_server_options(p)
    p.set_defaults(handler=delete_documents)


# ---- ask --url ------------------------------------------------------------------------------------


@handled
def ask_http(args: argparse.Namespace, print_answer: Callable[[dict[str, Any], bool], None]) -> int:
    """``ask --url``: the answer (streamed with ``--stream``) on stdout, errors on stderr."""
    from httpx_sse import connect_sse

    body = {
        "question": args.question,
        "document_ids": args.doc or [],
        "collection_ids": args.collection or [],
        "filter": args.filter,
        "max_tokens": args.max_tokens,
        "mode": args.mode,
        "stream": args.stream,
    }
    if args.session:
        body["session_id"] = args.session
    with http_client(str(args.url).rstrip("/"), args.api_key) as client:
        if not args.stream:
            response = client.post("/v1/ask", json=body)
            if response.status_code != 200:
                warn(error_text(response))
                return 1
            print_answer(response.json(), args.json)
            return 0
        with connect_sse(client, "POST", "/v1/ask", json=body) as events:
            if events.response.status_code != 200:
                events.response.read()
                warn(error_text(events.response))
                return 1
            failed = False
            for sse in events.iter_sse():
                if sse.event == "token":
                    sys.stdout.write(json.loads(sse.data)["text"])
                    sys.stdout.flush()
                elif sse.event == "error":
                    failed = True
                    warn(f"\nerror: {sse.data}")
                elif sse.event == "stats" and args.json:
                    warn(f"\n{sse.data}")
            say("")
            return 1 if failed else 0


REMOTE_SUBCOMMANDS: dict[str, Callable[[SubParsers], None]] = {"list": add_list, "delete": add_delete}
