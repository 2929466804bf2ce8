"""``ragspec collections``: ``create``, ``list``, ``show``, ``rename``, ``delete``, ``add``, ``remove``, ``documents``
(plugged into ``app.cli.main``), and the ``KEY=VALUE`` arguments of ``--metadata`` and ``ingest --attribute``.

As ``ingest`` does: with ``--url`` they talk HTTP to a running server (``app.cli.remote``); without it they work on
the document store under the data dir directly (no server, no model loaded), as ``--api-key``'s tenant (the default
tenant without one). Both paths go through the same operations (the routes' ``app.serving.catalogue`` in process) and
print the same lines; an error is one line on stderr (the server's status, code and message, or the code and message
the server would give) and exit status 1.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ValidationError

from app.cli.remote import ServerAddress, _detail, error_text, handled, http_client, say, server_url, warn
from app.schemas import PAGE_SIZE_MAX, CollectionIn, CollectionPatch

if TYPE_CHECKING:
    import httpx

    from retrieval.store import DocumentStore

SubParsers = Any


class CommandSettings(ServerAddress, Protocol):
    """What these commands read of the settings (the command's ``Settings`` is one): the server's address, and
    where the data dir's store is."""

    @property
    def documents_dir(self) -> Path: ...

    @property
    def max_pdf_pages(self) -> int: ...

    @property
    def database_url(self) -> str | None: ...


class CommandError(Exception):
    """What went wrong, as the one line the command prints."""


# ---- KEY=VALUE arguments --------------------------------------------------------------------------


def key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (the value may hold '='; it is kept as a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def attribute(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with the value read as JSON when it parses (``2024`` a number, ``true`` a boolean, ``"2024"`` a
    string), else as the string it is."""
    key, value = key_value(text)
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


# ---- the two paths --------------------------------------------------------------------------------


class Backend(Protocol):
    """The collections API, answered in REST's shapes (plain JSON values)."""

    def create(self, body: dict[str, Any]) -> dict[str, Any]: ...
    def page(self, limit: int, after: str | None) -> dict[str, Any]: ...
    def show(self, collection_id: str) -> dict[str, Any]: ...
    def update(self, collection_id: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def delete(self, collection_id: str, delete_documents: bool) -> None: ...
    def add(self, collection_id: str, doc_ids: list[str]) -> dict[str, Any]: ...
    def remove(self, collection_id: str, doc_id: str) -> None: ...
    def documents(self, collection_id: str, limit: int, after: str | None) -> dict[str, Any]: ...


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(p) for p in error["loc"]) or "body"
        raise CommandError(f"invalid_request: {loc}: {error['msg']}") from None


class LocalBackend:
    """The data dir's store, as ``tenant``: the same checks and operations as the routes."""

    def __init__(self, store: DocumentStore, tenant: str) -> None:
        from app.serving import catalogue  # the store's libraries load with the command, not with the parser

        self.ops = catalogue
        self.store = store
        self.tenant = tenant

    def _run(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``op(store, tenant, *args, **kwargs)``, a model answer as JSON values; a domain error as the server's
        code and message."""
        from app.errors import translate

        try:
            out = op(self.store, self.tenant, *args, **kwargs)
        except Exception as exc:
            err = translate(exc)
            if err is None:
                raise
            raise CommandError(f"{err.code}: {err.message}") from None
        return out.model_dump(mode="json") if isinstance(out, BaseModel) else out

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        valid = _validated(CollectionIn, body)
        return dict(self._run(self.ops.create_collection, valid.name, valid.description, valid.metadata))

    def page(self, limit: int, after: str | None) -> dict[str, Any]:
        return dict(self._run(self.ops.collection_page, limit, after))

    def show(self, collection_id: str) -> dict[str, Any]:
        return dict(self._run(self.ops.collection, collection_id))

    def update(self, collection_id: str, body: dict[str, Any]) -> dict[str, Any]:
        fields = _validated(CollectionPatch, body).model_dump(exclude_unset=True)
        return dict(self._run(self.ops.update_collection, collection_id, **fields))

    def delete(self, collection_id: str, delete_documents: bool) -> None:
        self._run(self.ops.delete_collection, collection_id, delete_documents=delete_documents)

    def add(self, collection_id: str, doc_ids: list[str]) -> dict[str, Any]:
        return dict(self._run(self.ops.add_documents, collection_id, doc_ids))

    def remove(self, collection_id: str, doc_id: str) -> None:
        self._run(self.ops.remove_document, collection_id, doc_id)

    def documents(self, collection_id: str, limit: int, after: str | None) -> dict[str, Any]:
        return dict(self._run(self.ops.document_page, collection_id, limit, after))


class HttpBackend:
    """A running server's ``/v1/collections``."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def _call(self, method: str, path: str, expect: int, **kwargs: Any) -> Any:
        response = self.client.request(method, path, **kwargs)
        if response.status_code != expect:
            raise CommandError(error_text(response))
        return response.json() if response.content else None

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/collections", 201, json=body))

    def page(self, limit: int, after: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
        return dict(self._call("GET", "/v1/collections", 200, params=params))

    def show(self, collection_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/collections/{collection_id}", 200))

    def update(self, collection_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("PATCH", f"/v1/collections/{collection_id}", 200, json=body))

    def delete(self, collection_id: str, delete_documents: bool) -> None:
        params = {"delete_documents": "true"} if delete_documents else None
        self._call("DELETE", f"/v1/collections/{collection_id}", 204, params=params)

    def add(self, collection_id: str, doc_ids: list[str]) -> dict[str, Any]:
        return dict(self._call("POST", f"/v1/collections/{collection_id}/documents", 200,
                               json={"document_ids": doc_ids}))

    def remove(self, collection_id: str, doc_id: str) -> None:
        self._call("DELETE", f"/v1/collections/{collection_id}/documents/{doc_id}", 204)

    def documents(self, collection_id: str, limit: int, after: str | None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
        return dict(self._call("GET", f"/v1/collections/{collection_id}/documents", 200, params=params))


def local_tenant(api_key: str | None) -> str:
    """The tenant a command without a server works as: ``--api-key``'s, else the default one."""
    from app.serving.auth import tenant_of_key
    from retrieval.store import DEFAULT_TENANT

    return tenant_of_key(api_key) if api_key else DEFAULT_TENANT


@contextmanager
def local_backend(args: argparse.Namespace, settings: CommandSettings) -> Iterator[Backend]:
    from retrieval.errors import RetrievalError
    from retrieval.store import DocumentStore

    try:
        store = DocumentStore(settings.documents_dir, max_pdf_pages=settings.max_pdf_pages,
                              database=settings.database_url)
    except RetrievalError as exc:
        raise CommandError(str(exc)) from None
    try:
        yield LocalBackend(store, local_tenant(args.api_key))
    finally:
        store.close()


def _all(fetch: Callable[[int, str | None], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every item of a paged list, page after page."""
    items: list[dict[str, Any]] = []
    after = None
    while True:
        page = fetch(PAGE_SIZE_MAX, after)
        items.extend(page["data"])
        if not page["has_more"] or not page["data"]:
            return items
        after = page["last_id"]


# ---- the commands ---------------------------------------------------------------------------------


def _counts(collection: dict[str, Any]) -> str:
    counts = collection["document_counts"]
    active = counts["queued"] + counts["indexing"]
    parts = [f"{counts['ready']} ready"] + ([f"{active} pending"] if active else []) + (
        [f"{counts['failed']} failed"] if counts["failed"] else [])
    return f"{counts['total']} documents ({', '.join(parts)})"


def _create(args: argparse.Namespace, backend: Backend) -> None:
    body: dict[str, Any] = {"name": args.name}
    if args.description is not None:
        body["description"] = args.description
    if args.metadata:
        body["metadata"] = dict(args.metadata)
    created = backend.create(body)
    say(f"{created['id']}\t{created['name']}")


def _list(args: argparse.Namespace, backend: Backend) -> None:
    collections = _all(backend.page)
    if args.json:
        say(json.dumps({"data": collections}, indent=2, ensure_ascii=False))
        return
    for c in collections:
        say(f"{c['id']}\t{c['name']}\t{_counts(c)}")


def _show(args: argparse.Namespace, backend: Backend) -> None:
    say(json.dumps(backend.show(args.id), indent=2, ensure_ascii=False))


def _rename(args: argparse.Namespace, backend: Backend) -> None:
    renamed = backend.update(args.id, {"name": args.name})
    say(f"{renamed['id']}\t{renamed['name']}")


def _delete(args: argparse.Namespace, backend: Backend) -> None:
    backend.delete(args.id, args.delete_documents)
    say(f"{args.id}\tdeleted{' with its documents' if args.delete_documents else ''}")


def _add(args: argparse.Namespace, backend: Backend) -> None:
    added = backend.add(args.id, args.docs)
    for doc_id in dict.fromkeys(args.docs):
        say(f"{doc_id}\tin {args.id}")
    say(f"{args.id}\t{_counts(added)}")


def _remove(args: argparse.Namespace, backend: Backend) -> None:
    backend.remove(args.id, args.doc)
    say(f"{args.doc}\tremoved from {args.id}")


def _documents(args: argparse.Namespace, backend: Backend) -> None:
    docs = _all(lambda limit, after: backend.documents(args.id, limit, after))
    if args.json:
        say(json.dumps({"data": docs}, indent=2, ensure_ascii=False))
        return
    for doc in docs:
        attributes = f"\t{json.dumps(doc['attributes'], ensure_ascii=False)}" if doc.get("attributes") else ""
        say(f"{doc['id']}\t{doc['status']}\t{doc['title']}\t{_detail(doc)}{attributes}")


Action = Callable[[argparse.Namespace, Backend], None]


@handled
def _http(args: argparse.Namespace, settings: CommandSettings, action: Action) -> int:
    with http_client(server_url(args, settings), args.api_key, timeout_s=60.0) as client:
        try:
            action(args, HttpBackend(client))
        except CommandError as exc:
            warn(str(exc))
            return 1
    return 0


def _run(args: argparse.Namespace, settings: CommandSettings) -> int:
    action: Action = args.action
    if args.url:
        return _http(args, settings, action)
    try:
        with local_backend(args, settings) as backend:
            action(args, backend)
    except CommandError as exc:
        warn(str(exc))
        return 1
    return 0


def _options(p: argparse.ArgumentParser, action: Action) -> None:
    p.add_argument("--url", default=None,
                   help="base URL of a running server, e.g. http://127.0.0.1:8000 (default: no server, the data dir's "
                   "store)")
    p.add_argument("--api-key", default=None,
                   help="Bearer key of the server (with --url), else work as this key's tenant")
    p.set_defaults(handler=_run, action=action)


def add_collections(sub: SubParsers) -> None:
    p = sub.add_parser(
        "collections",
        help="create, list, show, rename and delete collections, add and remove their documents (a server with "
        "--url, else the data dir's store)",
    )
    actions = p.add_subparsers(dest="collections_command", required=True, metavar="ACTION")

    create = actions.add_parser("create", help="create a collection (prints id, name)")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--description", default=None)
    create.add_argument("--metadata", type=key_value, action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="labels of your own (string values)")
    _options(create, _create)

    listed = actions.add_parser("list", help="your collections (id, name, document counts)")
    listed.add_argument("--json", action="store_true", help="print the collections as JSON")
    _options(listed, _list)

    show = actions.add_parser("show", help="a collection with its documents' counts by status (JSON)")
    show.add_argument("id", metavar="ID")
    _options(show, _show)

    rename = actions.add_parser("rename", help="rename a collection")
    rename.add_argument("id", metavar="ID")
    rename.add_argument("name", metavar="NAME")
    _options(rename, _rename)

    delete = actions.add_parser("delete", help="delete a collection (its documents stay unless --delete-documents)")
    delete.add_argument("id", metavar="ID")
    delete.add_argument("--delete-documents", action="store_true",
                        help="also delete its documents (those in other collections too)")
    _options(delete, _delete)

    add = actions.add_parser("add", help="add existing documents to a collection")
    add.add_argument("id", metavar="ID")
    add.add_argument("docs", nargs="+", metavar="DOC", help="document ids")
    _options(add, _add)

    remove = actions.add_parser("remove", help="take a document out of a collection (the document stays)")
    remove.add_argument("id", metavar="ID")
    remove.add_argument("doc", metavar="DOC")
    _options(remove, _remove)

    documents = actions.add_parser("documents", help="a collection's documents (id, status, title, detail, "
                                   "attributes)")
    documents.add_argument("id", metavar="ID")
    documents.add_argument("--json", action="store_true", help="print the documents as JSON")
    _options(documents, _documents)
