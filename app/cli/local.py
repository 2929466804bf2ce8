"""Service subcommands of ``ragspec``: ``ingest``, ``ask``, ``reindex``, ``kernels``, and from
``app.cli.remote`` ``list`` and ``delete`` (plugged into ``app.cli.main``).

``ingest`` and ``ask`` talk HTTP to a running server with ``--url`` (``app.cli.remote``). Without it, ``ingest``
and ``reindex`` work directly on the document store under the data dir (no server needed; the target's
tokenizer and the embedder are loaded, not the target model) and ``ask`` loads the whole service in process.
``ingest --collection ID --attribute KEY=VALUE`` puts every file in a collection with those attributes, either way
(the ``collections`` commands themselves are ``app.cli.collections``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mimetypes
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from app.cli.collections import attribute, local_tenant
from app.cli.progress import ProgressLine
from app.cli.remote import REMOTE_SUBCOMMANDS, ask_http, ingest_http
from app.schemas import AskMode
from app.settings import BUNDLED, Settings

logger = logging.getLogger(__name__)

SubParsers = Any


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _load_tokenizer(settings: Settings) -> Any:
    """The target's tokenizer only (chunk sizes are counted in target tokens); never downloads."""
    from transformers import AutoTokenizer

    from decoding.runtime.bundled import bundled_gguf_dir
    from decoding.runtime.loader import load_tokenizer

    source = bundled_gguf_dir(settings.models_dir) if settings.target_model == BUNDLED else settings.target_model
    if Path(str(source)).expanduser().exists():  # the service's own rule (a bare GGUF file carries its tokenizer)
        return load_tokenizer(str(source))
    return AutoTokenizer.from_pretrained(str(source), local_files_only=True)


def _open_store(settings: Settings) -> tuple[Any, Any, Any]:
    from retrieval.embedding import load_embedder
    from retrieval.store import DocumentStore

    store = DocumentStore(settings.documents_dir, max_pdf_pages=settings.max_pdf_pages,
                          database=settings.database_url)
    embedder = load_embedder(settings.embedding_model, settings.embedding_kind, settings.device)
    return store, _load_tokenizer(settings), embedder


def _ingest_one(
    settings: Settings, store: Any, tokenizer: Any, embedder: Any, doc_id: str, name: str
) -> tuple[bool, str]:
    """Index one stored document now, its progress on stderr as ``ingest --url`` shows a server's (the
    store calls back at each stage and embedding batch after writing them to the row, which is read here);
    returns whether it is ready and the summary's detail (its size, else the failure)."""
    from retrieval.errors import DocumentNotFound

    line = ProgressLine(name, sys.stderr)

    def show(_fraction: float) -> None:
        try:
            row = store.get(doc_id)
        except DocumentNotFound:  # deleted meanwhile: the ingest fails and says so
            return
        line.show(row.status, row.progress, row.message)

    try:
        record = store.ingest(
            doc_id, tokenizer, embedder, settings.chunk_tokens, settings.chunk_overlap, progress=show
        )
    except Exception as exc:  # the store marked it failed with this reason
        show(0.0)
        return False, str(exc)
    finally:
        line.close()
    return True, f"{record.n_chunks} chunks, {record.n_tokens} tokens"


# ---- ingest ---------------------------------------------------------------------------------------


def _ingest(args: argparse.Namespace, settings: Settings) -> int:
    from retrieval.errors import InvalidAttributes, RetrievalError
    from retrieval.filters import check_attributes

    try:  # checked before any file is read or sent
        check_attributes(dict(args.attribute))
    except InvalidAttributes as exc:
        sys.stderr.write(f"--attribute: {exc}\n")
        return 2
    if args.url:
        return ingest_http(args, settings)
    if args.no_wait:
        sys.stderr.write("--no-wait needs --url (without a server the files are indexed now)\n")
        return 2

    store, tokenizer, embedder = _open_store(settings)
    tenant = local_tenant(args.api_key)
    collection_ids = [args.collection] if args.collection else []
    failures = 0
    try:
        for cid in collection_ids:
            try:
                store.get_collection(cid, tenant)
            except RetrievalError as exc:
                sys.stderr.write(f"--collection: {exc}\n")
                return 1
        for path in map(Path, args.files):
            try:
                data = path.read_bytes()
                content_type = mimetypes.guess_type(path.name)[0]
                record = store.create(tenant, args.title, path.name, content_type, data,
                                      attributes=dict(args.attribute), collection_ids=collection_ids)
            except (OSError, RetrievalError) as exc:
                failures += 1
                sys.stderr.write(f"{path}: {exc}\n")
                continue
            ok, detail = _ingest_one(settings, store, tokenizer, embedder, record.id, path.name)
            failures += 0 if ok else 1
            say(f"{record.id}\t{'ready' if ok else 'failed'}\t{path}\t{detail}")
    finally:
        store.close()
    return 1 if failures else 0


def add_ingest(sub: SubParsers) -> None:
    p = sub.add_parser(
        "ingest",
        help="upload documents to a server with --url and follow their indexing, else index them into the "
        "data dir now (prints id, status, file, detail per file)",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="txt, md, html or pdf files")
    p.add_argument("--title", default=None, help="title for every file (default: from the file)")
    p.add_argument(
        "--url", default=None,
        help="base URL of a running server, e.g. http://127.0.0.1:8000 (default: no server, the local store)",
    )
    p.add_argument(
        "--api-key", default=None,
        help="Bearer key of the server (with --url), else store under this key's tenant",
    )
    p.add_argument("--no-wait", action="store_true", help="with --url: print the ids once uploaded, do not follow")
    p.add_argument("--collection", default=None, metavar="ID", help="put every file in this collection")
    p.add_argument(
        "--attribute", type=attribute, action="append", default=[], metavar="KEY=VALUE",
        help="an attribute of every file (repeatable); the value is read as JSON when it parses (2024 a number, true "
        "a boolean, '\"2024\"' a string), else it is a string",
    )
    p.set_defaults(handler=_ingest)


# ---- reindex --------------------------------------------------------------------------------------


def _reindex(args: argparse.Namespace, settings: Settings) -> int:
    if not args.all and not args.ids:
        sys.stderr.write("give document ids, or --all\n")
        return 2
    store, tokenizer, embedder = _open_store(settings)
    failures = 0
    try:
        store.recover()
        records = store.list() if args.all else [store.get(i) for i in args.ids]
        for record in records:
            ok, detail = _ingest_one(settings, store, tokenizer, embedder, record.id, record.id)
            failures += 0 if ok else 1
            say(f"{record.id}\t{'ready' if ok else 'failed'}\t{record.title}\t{detail}")
        say(f"re-indexed {len(records) - failures} of {len(records)} documents with {embedder.name}")
    finally:
        store.close()
    return 1 if failures else 0


def add_reindex(sub: SubParsers) -> None:
    p = sub.add_parser("reindex", help="rebuild document indexes with the configured embedder")
    p.add_argument("ids", nargs="*", metavar="ID", help="documents to re-index")
    p.add_argument("--all", action="store_true", help="every document of every tenant")
    p.set_defaults(handler=_reindex)


# ---- ask ------------------------------------------------------------------------------------------


def _print_answer(body: dict[str, Any], as_json: bool) -> None:
    if as_json:
        say(json.dumps(body, indent=2, ensure_ascii=False))
        return
    say(body.get("cited_answer") or body["answer"])  # the answer with its [n] citations of the sources below
    for n, src in enumerate(body.get("sources", []), start=1):
        page, last = src.get("page"), src.get("page_end")
        pages = "" if page is None else f" p. {page}" if last in (None, page) else f" pp. {page}-{last}"
        title = f" {src['title']!r}" if src.get("title") else ""
        say(f"  [{n}] {src['document_id']}:{src['chunk_id']}{title}{pages} score {src['score']:.2f}: "
            f"{src['text'][:80]!r}")


def _ask_local(args: argparse.Namespace, settings: Settings) -> int:
    from app.answering import pipeline as answering
    from app.answering.events import Finished, Token
    from app.answering.pipeline import Question
    from app.answering.sampling import sampling_params
    from app.errors import translate
    from app.schemas import LogitControls
    from app.services import load_services

    services = load_services(settings.model_copy(update={"calibrate": False}))
    tenant = local_tenant(args.api_key)
    question = Question(  # greedy with the server's default penalties, as an API request that sets none
        question=args.question,
        document_ids=args.doc or [],
        collection_ids=args.collection or [],
        filter=args.filter,
        max_tokens=args.max_tokens,
        sampling=sampling_params(LogitControls.model_validate({}), services.config.penalties, services.vocab_size,
                                 temperature=0.0, top_p=1.0, seed=None),
        mode=args.mode,
    )

    async def run() -> dict[str, Any]:
        done: Finished | None = None
        async for event in answering.answer(services, tenant, question):
            if isinstance(event, Token) and args.stream:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, Finished):
                done = event
        if done is None:  # an answer ends with Finished or raises
            raise RuntimeError("the answer ended without finishing")
        return {
            "answer": done.text,
            "cited_answer": done.citations.cited_answer,
            "citations": [c.model_dump() for c in done.citations.citations],
            "sources": [s.model_dump() for s in done.sources],
            "stats": done.stats.model_dump(),
        }

    try:
        body = asyncio.run(run())
    except Exception as exc:
        err = translate(exc)
        if err is None:
            raise
        sys.stderr.write(f"{err.code}: {err.message}\n")
        return 1
    finally:
        services.close()
    if args.stream:
        say("")
    else:
        _print_answer(body, args.json)
    return 0


def _ask(args: argparse.Namespace, settings: Settings) -> int:
    if not args.doc and not args.collection:
        sys.stderr.write("give --doc or --collection (or both)\n")
        return 2
    return ask_http(args, _print_answer) if args.url else _ask_local(args, settings)


def _filter_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a filter is a JSON object")
    return value


def add_ask(sub: SubParsers) -> None:
    p = sub.add_parser("ask", help="ask a question over documents (HTTP with --url, else in process)")
    p.add_argument("question")
    p.add_argument("--doc", action="append", metavar="ID", help="document id (repeatable)")
    p.add_argument("--collection", action="append", metavar="ID",
                   help="collection id (repeatable): ask every ready document of it, or those matching --filter")
    p.add_argument("--filter", type=_filter_json, default=None, metavar="JSON",
                   help='an attribute filter, e.g. \'{"type": "eq", "key": "year", "value": 2024}\'')
    p.add_argument("--url", default=None, help="base URL of a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="Bearer key (server with keys / tenant in process)")
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--mode", default="auto", choices=get_args(AskMode))
    p.add_argument("--session", default=None, help="session id to continue (HTTP only)")
    p.add_argument("--json", action="store_true", help="print the whole JSON response")
    p.set_defaults(handler=_ask)


def _kernels(args: argparse.Namespace, settings: Settings) -> int:
    from app.services import configure_kernels
    from decoding.runtime import kernels

    configure_kernels(settings)
    try:
        isas = kernels.built_isas() if args.all else [kernels.config().isa]  # the configured path last
        for library in kernels.build_all(isas, force=args.force):  # every path's sources compiled at once
            say(str(library))
    except (OSError, RuntimeError) as exc:
        sys.stderr.write(f"ragspec kernels: {exc}\n")
        return 1
    return 0


def add_kernels(sub: SubParsers) -> None:
    p = sub.add_parser("kernels", help="build the CPU kernels of RAGSPEC_CPU_ISA's path into RAGSPEC_KERNEL_CACHE "
                                       "now (prints the library)")
    p.add_argument("--force", action="store_true", help="rebuild even if the library is there")
    p.add_argument("--all", action="store_true", help="build every ISA path (an image built on one CPU may run on "
                                                      "another; one line each, RAGSPEC_CPU_ISA's last)")
    p.set_defaults(handler=_kernels)


SERVICE_SUBCOMMANDS: dict[str, Callable[[SubParsers], None]] = {
    "ingest": add_ingest,
    "ask": add_ask,
    "reindex": add_reindex,
    "kernels": add_kernels,
    **REMOTE_SUBCOMMANDS,  # list, delete (app.cli.remote)
}
