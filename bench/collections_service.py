"""bench.collections' service sections: a collection through a real ragspec server (bundled SmolLM2 + MiniLM, a data
dir in a temp dir), over its HTTP API.

* ``ingest``: ``bench.library``'s documents (CPython's documentation, PSF licence; ``--library-docs``, 1,200) uploaded
  into one collection in multi-file requests (``POST /v1/documents`` multipart, ``--upload-batch`` files each, with
  ``collection_id``) to ``python -m app.cli.main serve`` in a subprocess, then ``GET /v1/collections/{id}`` polled
  until every document is ready. A request takes one ``attributes`` object for all its files, so the files are grouped
  by the attributes they share (``GROUP_KEYS``: ``kind``, ``tier``, ``deprecated``) and each document's own
  (``package``, ``module``, ``size_kb``, ``year``) is set by ``PATCH /v1/documents/{id}`` right after its request.
  Reported: documents per minute and embedded tokens per second (the embedder's tokenizer over exactly the windows
  ingestion embeds: ``retrieval.chunking.passage_spans`` of each 512-token chunk, read back from the store after the
  run), beside the embedder alone on the same window texts in this process with the same batch size, one ``encode``
  per document as ingestion calls it (run before, between and after the servers: they give the noise band), and in
  one call over every window (batches across documents). ``overhead`` = ingest wall time / embedder-alone time - 1
  (goal <= 15 %). The server runs as shipped (``--ingest-variants kv_cache``: its KV cache on, so whatever
  ``Services.documents_ready`` warms in the background shares the CPU with the embedding; since 8f5b65c a document
  uploaded into a collection is no longer warmed alone) and with the KV cache off (``no_kv_cache``:
  ``RAGSPEC_KV_CACHE_BYTES=0``, nothing warmed); ``server_prefill_rows`` counts the target tokens warmed during the
  upload. The upload request time per file and the PATCH time per document apart.
* ``quality``: bench/data's QA set (``bench.datasets.load_qa``) asked over one collection of all its documents plus
  ``--quality-distractors`` (200) library documents, without naming the document, against each question asked with
  its document named. A server in this process (``ThreadServer``-like: uvicorn in a thread, its ``Services`` at hand)
  runs the API's own planning, ``app.answering.pipeline.admit`` + ``plan`` (``Retriever.rank`` for a named document,
  ``Retriever.rank_library`` over the collection's index past the window), so the sources are exactly what
  ``/v1/ask`` would show: for how many questions the best source holds the evidence (its span overlaps the answer
  passage in the right document), the share in any source, and the rank of the best evidence chunk in the ranking (the
  one ``plan`` cuts the sources from: every chunk of a named document; the collection's candidates). Held-out questions
  apart; the same over a collection of the QA documents alone, to tell what they cost each other from what the
  distractors add. The KV cache is off there (no generation runs, so no warm-up competes with the questions).
* ``ttft``: time to first token through ``/v1/ask`` streams (the wall time to the first ``token`` event, and
  ``stats.ttft_ms``) for a collection that fits the target's window (``--ttft-docs`` documents read whole: the
  smallest QA documents, then library documents, within the window) against the same documents asked one at a time
  (``document_ids=[one]``), each cold (every KV prefix holding the documents dropped first with
  ``Services.forget_document``, after the upload's warm-ups finished; ``prefix_reused_tokens`` 0 checks it) and warm
  (a second, different question): medians over ``--ttft-rounds`` rounds and the spread. Then the library collection,
  past the window: ``Retriever.rank_library`` as ``plan`` calls it (``pipeline._rank_library``), timed in process, as a
  share of the question's TTFT over HTTP (goal <= 10 %), with the collection index as ingested (a few thousand chunks)
  and padded to ``--ttft-pad-chunks`` (100K) chunk vectors: synthetic documents of ``PAD_CHUNKS_PER_DOC`` chunks (real
  chunk vectors with noise, real chunks' terms) added with ``CollectionIndex.add`` under fake ids, the index's synced
  version set to the catalogue's so the sync keeps them. The store does not know the fake documents, so
  ``rank_library`` drops their candidates before fine scoring: the padded figure times the index's search at 100K and
  the fine scoring of the real candidates only; ``estimate_100k_ms`` adds the fine scoring measured unpadded.

``python -m bench.collections --sections ingest,quality,ttft`` runs them in one process: quality and ttft reuse the
ingest's data dir (else they upload the library first, unmeasured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import REPO, median, out
from bench.datasets import load_qa, locate, passage_pattern
from bench.library import LICENCE, LibraryDoc, fingerprint, library_documents, python_version
from tests.app.live import wait_for
from tests.conftest import free_port

MODELS_DIR = REPO / "data" / "models"
DEADLINE_S = 3 * 3600.0  # "it never happened" bounds, not speed assertions
POLL_S = 1.0
GROUP_KEYS = ("kind", "tier", "deprecated")  # attributes a request's files share; the rest PATCHed per document
INGEST_VARIANTS = {"kv_cache": {}, "no_kv_cache": {"RAGSPEC_KV_CACHE_BYTES": "0"}}
SERVER_ENV = {"RAGSPEC_CALIBRATE": "false", "RAGSPEC_LOG_LEVEL": "WARNING"}
GOAL_INGEST_OVERHEAD = 0.15
GOAL_RETRIEVAL_SHARE = 0.10
CHUNK_TOKENS = 512  # the server's default chunk size (RAGSPEC_CHUNK_TOKENS), which ingestion cuts at
ASK_TOKENS = 4  # max_tokens of a timed question: its first token is what is timed
PAD_CHUNKS_PER_DOC = 50
PAD_NOISE = 0.8  # a padding chunk: a real chunk's vector plus noise of this norm (cosine ~0.6 to it), normalized
# Questions over the library (Python's documentation); none is scored, they are timed. Each phase asks its own, so no
# question finds its chunks' KV cached by an earlier phase.
LIBRARY_QUESTIONS = (
    "How do I read a JSON document from a file object?",
    "What does the timeout argument of subprocess.run do when it expires?",
    "How can I create a temporary directory that is removed automatically?",
    "What does functools.lru_cache do when maxsize is None?",
    "How do I parse command line options with a help message?",
    "How is a context manager's __exit__ method called when an exception is raised in a with block?",
    "How can I compress a file with gzip?",
    "What does the encoding argument of open() do?",
)


# ---- servers ------------------------------------------------------------------------------------------------


@dataclass
class ProcessServer:
    """``python -m app.cli.main serve`` (``ragspec serve``) in a subprocess on a free loopback port."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    start_s: float


@contextlib.contextmanager
def process_server(data_dir: Path, env: dict[str, str]) -> Iterator[ProcessServer]:
    from decoding.runtime.bundled.install import install_bundled

    install_bundled(MODELS_DIR)
    port = free_port()
    log_path = data_dir.parent / f"server-{port}.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "RAGSPEC_DATA_DIR": str(data_dir),
            "RAGSPEC_MODELS_DIR": str(MODELS_DIR), **SERVER_ENV, **env}
    began = time.perf_counter()
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli.main", "serve", "--host", "127.0.0.1", "--port",
                                 str(port)], cwd=REPO, env=full, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, "the server to start", deadline_s=600, every_s=0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        yield ProcessServer(url, proc, log_path, time.perf_counter() - began)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


@dataclass
class ThreadServer:
    """``create_app(settings)`` under uvicorn in a thread of this process (as tests/app/live.py's), its ``Services``
    at hand for what the benchmark calls in process."""

    url: str
    app: Any
    start_s: float

    @property
    def services(self) -> Any:
        return self.app.state.services


@contextlib.contextmanager
def thread_server(data_dir: Path, **overrides: Any) -> Iterator[ThreadServer]:
    import uvicorn

    from app.main import create_app
    from app.settings import Settings
    from decoding.runtime.bundled.install import install_bundled

    install_bundled(MODELS_DIR)
    settings = Settings(data_dir=data_dir, models_dir=MODELS_DIR, calibrate=False,  # type: ignore[call-arg]
                        **{k: v for k, v in overrides.items() if v is not None})
    port = free_port()
    began = time.perf_counter()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "the server to start", deadline_s=600)
        if not server.started:
            raise RuntimeError("the server failed to start")
        yield ThreadServer(f"http://127.0.0.1:{port}", app, time.perf_counter() - began)
    finally:
        server.should_exit = True
        thread.join(120)


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=600)


def checked(response: httpx.Response, *status: int) -> Any:
    if response.status_code not in status:
        raise RuntimeError(f"{response.request.method} {response.request.url.path}: {response.status_code} "
                           f"{response.text[:500]}")
    return response.json() if response.content else None


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc (0.0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric_values(http: httpx.Client) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line and " " in line:
            name, value = line.rsplit(" ", 1)
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


# ---- uploads ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Upload:
    filename: str
    text: str
    attributes: dict[str, Any] = field(default_factory=dict)


def upload_files(http: httpx.Client, files: Sequence[Upload], collection_id: str,
                 attributes: dict[str, Any] | None = None) -> tuple[list[str], float]:
    """One multipart ``POST /v1/documents`` of ``files`` into the collection: their ids and the request's seconds."""
    parts = [("file", (f.filename, f.text.encode("utf-8"), "text/plain")) for f in files]
    data = {"collection_id": collection_id}
    if attributes:
        data["attributes"] = json.dumps(attributes)
    t = time.perf_counter()
    body = checked(http.post("/v1/documents", files=parts, data=data), 202)
    seconds = time.perf_counter() - t
    accepted = body.get("documents", [body])
    return [str(d["id"]) for d in accepted], seconds


def create_collection(http: httpx.Client, name: str) -> str:
    return str(checked(http.post("/v1/collections", json={"name": name}), 201)["id"])


def wait_collection(http: httpx.Client, collection_id: str, poll_s: float = POLL_S,
                    began: float | None = None) -> tuple[dict[str, Any], list[tuple[float, int]]]:
    """Poll ``GET /v1/collections/{id}`` until none of its documents is queued or indexing: the last answer and the
    timeline (seconds since ``began``, ready documents) of every poll where the count moved."""
    began = time.perf_counter() if began is None else began
    timeline: list[tuple[float, int]] = []
    end = time.monotonic() + DEADLINE_S
    while True:
        record = checked(http.get(f"/v1/collections/{collection_id}"), 200)
        counts = record["document_counts"]
        if not timeline or timeline[-1][1] != counts["ready"]:
            timeline.append((round(time.perf_counter() - began, 2), counts["ready"]))
        if counts["queued"] + counts["indexing"] == 0:
            return record, timeline
        if time.monotonic() > end:
            raise RuntimeError(f"collection {collection_id} still indexing: {counts}")
        time.sleep(poll_s)


def library_uploads(docs: Sequence[LibraryDoc]) -> list[Upload]:
    return [Upload(f"{i:04d} {d.title[:80].replace('/', '_')}.txt", d.text, dict(d.attributes))
            for i, d in enumerate(docs)]


def request_groups(uploads: Sequence[Upload], per_request: int) -> list[list[int]]:
    """Indexes of ``uploads`` in requests of at most ``per_request`` files sharing the ``GROUP_KEYS`` attributes (the
    library's order kept within a group)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, u in enumerate(uploads):
        groups.setdefault(tuple(u.attributes.get(k) for k in GROUP_KEYS), []).append(i)
    return [members[lo:lo + per_request] for members in groups.values() for lo in range(0, len(members), per_request)]


@dataclass
class Ingested:
    """A library uploaded into a collection: the ids in the uploads' order and what the upload measured."""

    collection_id: str
    ids: list[str]
    record: dict[str, Any]
    timeline: list[tuple[float, int]]
    wall_s: float  # first request sent -> every document ready (or failed)
    upload_s: float  # the POSTs and PATCHes
    post_s: list[float]  # per request
    post_files: list[int]
    patch_s: list[float]  # per document


def upload_library(http: httpx.Client, uploads: Sequence[Upload], per_request: int, name: str = "library",
                   poll_s: float = POLL_S) -> Ingested:
    collection_id = create_collection(http, name)
    ids = [""] * len(uploads)
    post_s, post_files, patch_s = [], [], []
    began = time.perf_counter()
    for batch in request_groups(uploads, per_request):
        shared = {k: uploads[batch[0]].attributes[k] for k in GROUP_KEYS if k in uploads[batch[0]].attributes}
        got, seconds = upload_files(http, [uploads[i] for i in batch], collection_id, shared)
        post_s.append(seconds)
        post_files.append(len(batch))
        for i, doc_id in zip(batch, got, strict=True):
            ids[i] = doc_id
            rest = {k: v for k, v in uploads[i].attributes.items() if k not in shared}
            if rest:
                t = time.perf_counter()
                checked(http.patch(f"/v1/documents/{doc_id}", json={"attributes": uploads[i].attributes}), 200)
                patch_s.append(time.perf_counter() - t)
    upload_s = time.perf_counter() - began
    record, timeline = wait_collection(http, collection_id, poll_s, began)
    return Ingested(collection_id, ids, record, timeline, time.perf_counter() - began, upload_s, post_s, post_files,
                    patch_s)


# ---- the library shared by the sections ----------------------------------------------------------------------


@dataclass
class Library:
    """The library ingested into a data dir (kept while this process runs), for quality and ttft."""

    data_dir: Path
    collection_id: str
    ids: list[str]
    docs: list[LibraryDoc]
    holder: tempfile.TemporaryDirectory[str]


_LIBRARY: Library | None = None


def _drop_kv_files(data_dir: Path) -> None:
    shutil.rmtree(data_dir / "kv", ignore_errors=True)  # the warm-ups' persisted KV: not read again


def ensure_library(args: argparse.Namespace) -> Library:
    """The ingest section's library, or (run without it) the same documents uploaded now, unmeasured (KV cache off)."""
    global _LIBRARY
    if _LIBRARY is not None and len(_LIBRARY.ids) >= args.library_docs:
        return _LIBRARY
    docs = library_documents(args.library_docs, seed=0)
    holder = tempfile.TemporaryDirectory(prefix="ragspec-bench-library-")
    data_dir = Path(holder.name) / "data"
    out(f"  uploading the library ({len(docs)} documents, unmeasured) ...")
    with process_server(data_dir, {**INGEST_VARIANTS["no_kv_cache"], **_context_env(args)}) as server, \
            client(server.url) as http:
        done = upload_library(http, library_uploads(docs), args.upload_batch)
    _LIBRARY = Library(data_dir, done.collection_id, done.ids, docs, holder)
    return _LIBRARY


def _context_env(args: argparse.Namespace) -> dict[str, str]:
    return {"RAGSPEC_MAX_CONTEXT": str(args.server_max_context)} if args.server_max_context else {}


# ---- ingest ---------------------------------------------------------------------------------------------------


def windows_offline(docs: Sequence[LibraryDoc], tokenizer: Any, chunk_tokens: int) -> list[list[str]]:
    """Each document's window texts as ``DocumentStore.ingest`` cuts them (target tokens, chunks, passage spans)."""
    from retrieval.chunking import chunk_text, passage_spans, tokenize

    found = []
    for d in docs:
        tokens = tokenize(d.text, tokenizer)
        chunks = chunk_text(d.text, tokenizer, chunk_tokens, 0, None, tokens=tokens)
        found.append([d.text[a:b] for c in chunks for a, b in passage_spans(c)])
    return found


def windows_stored(data_dir: Path, ids: Sequence[str]) -> list[list[str]]:
    """Each document's window texts as the server's ingestion embedded them, read back from its store."""
    from retrieval.store import DocumentStore

    store = DocumentStore(data_dir / "documents")
    try:
        found = []
        for doc_id in ids:
            text = store.load_text(doc_id)
            passages = store.load_passages(doc_id)
            if passages is None:
                raise RuntimeError(f"document {doc_id} has no windows")
            found.append([text[a:b] for _, a, b in passages.tolist()])
        return found
    finally:
        store.close()


def embedder_tokens(embedder: Any, texts: Sequence[str]) -> tuple[int, int, int]:
    """Tokens the embedder embeds for ``texts`` (its tokenizer, special tokens included, truncated at its limit as
    ``encode`` truncates), the count without truncation, and the texts truncated."""
    tokenizer = embedder._tokenizer  # the tokenizer ``encode`` calls
    embedded = untruncated = cut = 0
    for lo in range(0, len(texts), 512):
        part = list(texts[lo:lo + 512])
        full = tokenizer(part, truncation=False, padding=False)["input_ids"]
        for ids in full:
            n = len(ids)
            untruncated += n
            embedded += min(n, embedder.max_length)
            cut += n > embedder.max_length
    return embedded, untruncated, cut


def embed_alone(embedder: Any, windows: Sequence[Sequence[str]], batch_size: int) -> float:
    """Seconds the embedder takes over every document's windows, one ``encode`` per document (as ingestion)."""
    t = time.perf_counter()
    for texts in windows:
        embedder.encode(list(texts), batch_size=batch_size)
    return time.perf_counter() - t


def _stats(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    v = sorted(x * scale for x in values)
    return {"n": len(v), "median": round(median(v), digits), "mean": round(statistics.fmean(v), digits),
            "min": round(v[0], digits), "max": round(v[-1], digits),
            "p95": round(v[min(len(v) - 1, int(0.95 * len(v)))], digits)}


def run_ingest(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    global _LIBRARY
    from bench.retrieval import load_target_tokenizer
    from retrieval.embedding import DEFAULT_BATCH_SIZE, load_embedder

    docs = library_documents(args.library_docs, seed=0)
    uploads = library_uploads(docs)
    chars, nbytes = sum(len(d.text) for d in docs), sum(len(d.text.encode("utf-8")) for d in docs)
    out(f"ingest: {len(docs)} library documents, {chars} characters, variants {args.ingest_variants}")
    tokenizer = load_target_tokenizer()  # the served GGUF dir's tokenizer, which the server's ingestion cuts with
    embedder = load_embedder("bundled", device="cpu")
    offline = windows_offline(docs, tokenizer, CHUNK_TOKENS)
    flat = [t for ws in offline for t in ws]
    tokens, untruncated, cut = embedder_tokens(embedder, flat)
    target_tokens = sum(len(tokenizer(d.text, add_special_tokens=False, verbose=False)["input_ids"]) for d in docs)
    batch = DEFAULT_BATCH_SIZE
    embedder.encode(flat[:batch], batch_size=batch)  # its first call's set-up, out of the timings
    alone = [embed_alone(embedder, offline, batch)]
    out(f"  embedder alone, one encode per document: {alone[0]:.1f} s for {len(flat)} windows, {tokens} tokens "
        f"({tokens / alone[0]:.0f} tokens/s)")
    result: dict[str, Any] = {
        "text": {"corpus": "bench.library: CPython's documentation (docstrings, language reference)",
                 "licence": LICENCE, "python": python_version(), "fingerprint": fingerprint(docs),
                 "documents": len(docs), "chars": chars, "bytes": nbytes, "target_tokens": target_tokens,
                 "windows": len(flat), "embedder_tokens": tokens, "embedder_tokens_untruncated": untruncated,
                 "windows_truncated": cut},
        "chunk_tokens": CHUNK_TOKENS, "batch_size": batch, "upload_batch": args.upload_batch,
        "attributes": {"at_upload": list(GROUP_KEYS), "patched": "each document's full attributes, right after its "
                       "request (a multipart request takes one attributes object for all its files)"},
        "server": {"command": "python -m app.cli.main serve", "env": SERVER_ENV, "models": "bundled SmolLM2-135M "
                   "(Q4_1 GGUF) + all-MiniLM-L6-v2", **({"max_context": args.server_max_context}
                                                     if args.server_max_context else {})},
        "variants": {},
    }
    save(result)
    holder: tempfile.TemporaryDirectory[str] | None = None
    kept: Ingested | None = None
    windows, same = offline, True
    for v, variant in enumerate(args.ingest_variants):
        if holder is not None:
            holder.cleanup()
        holder = tempfile.TemporaryDirectory(prefix=f"ragspec-bench-ingest-{variant}-")
        data_dir = Path(holder.name) / "data"
        out(f"  {variant}: starting the server ...")
        with process_server(data_dir, {**INGEST_VARIANTS[variant], **_context_env(args)}) as server, \
                client(server.url) as http:
            before, cpu = metric_values(http), process_cpu_s(server.proc.pid)
            done = upload_library(http, uploads, args.upload_batch, poll_s=args.poll_s)
            after, cpu = metric_values(http), process_cpu_s(server.proc.pid) - cpu
        _drop_kv_files(data_dir)
        kept = done
        if v == 0:  # what the server embedded, read back: the texts timed from now on
            windows = windows_stored(data_dir, done.ids)
            same = windows == offline
            if not same:
                out(f"  note: {sum(a != b for a, b in zip(windows, offline, strict=True))} documents' stored "
                    "windows differ from the offline cut; the stored ones are counted and timed from now on")
                tokens, untruncated, cut = embedder_tokens(embedder, [t for ws in windows for t in ws])
                result["text"].update(embedder_tokens=tokens, embedder_tokens_untruncated=untruncated,
                                      windows_truncated=cut, windows=sum(len(ws) for ws in windows))
        alone.append(embed_alone(embedder, windows, batch))  # between two variants, and after the last
        counts = done.record["document_counts"]
        row = _ingest_row(done, server.start_s, before, after, len(docs), tokens, (alone[v] + alone[v + 1]) / 2)
        row["server_cpu_s"] = round(cpu, 1)
        row["server_cores_busy"] = round(cpu / done.wall_s, 2)
        result["variants"][variant] = row
        out(f"  {variant}: {counts['ready']} ready, {counts['failed']} failed in {done.wall_s:.1f} s "
            f"(uploads {done.upload_s:.1f} s): {row['documents_per_minute']:.0f} documents/min, "
            f"{row['embedded_tokens_per_s']:.0f} embedder tokens/s; the embedder alone {alone[v]:.1f} s before, "
            f"{alone[v + 1]:.1f} s after: overhead {row['overhead']:+.1%}; the warm-ups prefilled "
            f"{row['server_prefill_rows']:.0f} target tokens")
        save(result)
    assert holder is not None and kept is not None
    data_dir = Path(holder.name) / "data"
    t = time.perf_counter()
    embedder.encode([w for ws in windows for w in ws], batch_size=batch)
    one_call = time.perf_counter() - t
    alone_s = median(alone)
    out(f"  one encode over every window: {one_call:.1f} s")
    for row in result["variants"].values():
        row["overhead_vs_median_embed"] = round(row["wall_s"] / alone_s - 1, 4)
        row["overhead_vs_one_call"] = round(row["wall_s"] / one_call - 1, 4)
    primary_name = args.ingest_variants[0]
    primary = result["variants"][primary_name]
    result.update({
        "windows_match_store": same,
        "embed_alone": {"per_document_s": [round(a, 2) for a in alone], "median_s": round(alone_s, 2),
                        "tokens_per_s": round(tokens / alone_s, 1), "spread": _spread(alone),
                        "one_call_s": round(one_call, 2), "one_call_tokens_per_s": round(tokens / one_call, 1)},
        "primary": primary_name,
        "documents_per_minute": primary["documents_per_minute"],
        "embedded_tokens_per_s": primary["embedded_tokens_per_s"],
        "embedder_tokens_per_s": primary["embedder_tokens_per_s"],
        "overhead": primary["overhead"],
        "upload_ms_per_file": primary["upload"]["post_ms_per_file"],
        "goal": {"max_overhead": GOAL_INGEST_OVERHEAD,
                 "met": {name: row["overhead"] <= GOAL_INGEST_OVERHEAD for name, row in result["variants"].items()}},
        "notes": [
            "wall_s runs from the first upload request to the poll that found every document ready (polled every "
            f"{args.poll_s} s); it includes the uploads and PATCHes, which run while the first documents index.",
            "embed_alone: this process, the same window texts (read back from the store after the first variant), one "
            "encode per document with the server's batch size, before the first variant, between the variants and "
            "after the last (per_document_s, in that order); a variant's overhead is its wall time over the mean of "
            "the runs just before and after it, less 1; one_call_s: one encode over every window (batches across "
            "documents, the embedder at its best).",
            "kv_cache is the server as shipped (its KV cache on): what Services.documents_ready warms on the "
            "scheduler's background shares the CPU with the embedding; server_prefill_rows counts the target tokens "
            "prefilled during the upload (0 since 8f5b65c: a document uploaded into a collection is no longer "
            "warmed alone, and a 1,200-document collection is past the window, so nothing is warmed).",
            "a shared 2-core machine: two torch threads slow down several-fold whenever another process takes a "
            "core, so compare figures within this run, and see the load averages.",
        ],
        "load_average_at_end": list(os.getloadavg()),
    })
    _LIBRARY = Library(data_dir, kept.collection_id, kept.ids, docs, holder)
    return result


def _ingest_row(done: Ingested, start_s: float, before: dict[str, float], after: dict[str, float], n: int,
                tokens: int, alone_s: float) -> dict[str, Any]:
    """One variant's figures; ``alone_s``: the embedder alone on the same windows, next to it in time."""
    counts = done.record["document_counts"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    files = sum(done.post_files)
    return {
        "wall_s": round(done.wall_s, 2), "server_start_s": round(start_s, 2), "ready": counts["ready"],
        "failed": counts["failed"], "collection": {k: done.record[k] for k in ("chunks", "tokens", "bytes")},
        "documents_per_minute": round(n / done.wall_s * 60, 1),
        "embedded_tokens_per_s": round(tokens / done.wall_s, 1),
        "embedder_alone_s": round(alone_s, 2), "embedder_tokens_per_s": round(tokens / alone_s, 1),
        "overhead": round(done.wall_s / alone_s - 1, 4),
        "upload": {"requests": len(done.post_s), "files": files, "upload_s": round(done.upload_s, 2),
                   "post_s": _stats(done.post_s, digits=3),
                   "post_ms_per_file": round(sum(done.post_s) / files * 1000, 2),
                   "patch_ms": _stats(done.patch_s, 1000, 2)},
        "documents_per_minute_by_quarter": _by_quarter(done.timeline, n),
        "timeline": done.timeline if len(done.timeline) <= 60
        else [*done.timeline[:: max(1, len(done.timeline) // 60)], done.timeline[-1]],
        "server_prefill_rows": delta("ragspec_batch_prefill_rows_total"),
        "server_forward_s": round(delta("ragspec_batch_forward_seconds_total"), 2),
        "kv_cache_bytes_after": after.get("ragspec_kv_cache_bytes", 0.0),
        "kv_disk_bytes_after": after.get("ragspec_kv_disk_bytes", 0.0),
    }


def _by_quarter(timeline: Sequence[tuple[float, int]], n: int) -> list[float | None]:
    """Documents per minute over each quarter of the documents (from the poll that saw a quarter's first document
    ready to the one that saw its last): whether ingestion slows as the collection grows."""
    rates: list[float | None] = []
    for q in range(4):
        lo, hi = n * q // 4, n * (q + 1) // 4
        start = next((t for t, ready in timeline if ready >= max(lo, 1)), None)
        end = next((t for t, ready in timeline if ready >= hi), None)
        rates.append(round((hi - max(lo, 1)) / (end - start) * 60, 1) if start is not None and end is not None
                     and end > start and hi > max(lo, 1) else None)
    return rates


# ---- quality --------------------------------------------------------------------------------------------------


@dataclass
class Judged:
    held_out: bool
    top1: bool  # the best source holds the evidence
    in_sources: bool
    sources: int
    rank: int | None  # 1-based rank of the best evidence chunk in the ranking (None: not in it)
    top_document: str  # "own", "other_qa", "library", "none"
    in_prompt: bool = False  # the answer passage is in the target's prompt (whole)


def _overlaps(doc_id: str, start: int, end: int, d: str, s: int, e: int) -> bool:
    return d == doc_id and s < end and start < e


def judge(sources: Sequence[Any], hits: Sequence[Any], doc_id: str, span: tuple[int, int], held_out: bool,
          qa_ids: set[str]) -> Judged:
    start, end = span
    ranked = sorted(hits, key=lambda h: -h.score)
    rank = next((r for r, h in enumerate(ranked, 1)
                 if _overlaps(doc_id, start, end, h.document_id, h.start, h.end)), None)
    holds = [_overlaps(doc_id, start, end, s.document_id, s.start, s.end) for s in sources]
    top = "none" if not sources else "own" if sources[0].document_id == doc_id else \
        "other_qa" if sources[0].document_id in qa_ids else "library"
    return Judged(held_out, bool(holds and holds[0]), any(holds), len(sources), rank, top)


def summarise(judged: Sequence[Judged]) -> dict[str, Any]:
    n = len(judged)
    ranks = [j.rank for j in judged if j.rank is not None]
    tops: dict[str, int] = {}
    for j in judged:
        tops[j.top_document] = tops.get(j.top_document, 0) + 1
    return {
        "questions": n,
        "best_source_holds_evidence": sum(j.top1 for j in judged),
        "best_source_share": round(sum(j.top1 for j in judged) / max(n, 1), 4),
        "evidence_in_sources": sum(j.in_sources for j in judged),
        "mean_sources": round(statistics.fmean([j.sources for j in judged]), 2) if judged else 0.0,
        "evidence_rank_mean": round(statistics.fmean(ranks), 2) if ranks else None,
        "evidence_rank_median": median(ranks) if ranks else None,
        "evidence_not_ranked": n - len(ranks),
        "mrr": round(sum(1 / j.rank for j in judged if j.rank) / max(n, 1), 4),
        "best_source_document": tops,
        "evidence_in_prompt": sum(j.in_prompt for j in judged),
    }


def run_quality(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from app.answering.followup import retrieval_queries
    from app.answering.pipeline import Question, _rank_library, admit, plan
    from decoding.speculative.generation import SamplingParams
    from retrieval.store import DEFAULT_TENANT

    qa = load_qa()
    if args.quality_docs:
        qa = sorted(qa, key=lambda d: len(d.text))[: args.quality_docs]
    library = ensure_library(args)
    n_distractors = min(args.quality_distractors, len(library.ids))
    step = len(library.ids) / max(n_distractors, 1)
    distractors = [library.ids[int(i * step)] for i in range(n_distractors)]
    out(f"quality: {len(qa)} QA documents ({sum(len(d.questions) for d in qa)} questions) + {n_distractors} "
        "library documents in one collection")
    with thread_server(library.data_dir, kv_cache_bytes=0, max_context=args.server_max_context) as server, \
            client(server.url) as http:
        services = server.services
        cid = create_collection(http, "qa + distractors")
        uploads = [Upload(d.filename, d.text) for d in qa]
        ids, _ = upload_files(http, uploads, cid)
        if distractors:
            checked(http.post(f"/v1/collections/{cid}/documents", json={"document_ids": distractors}), 200)
        record, _ = wait_collection(http, cid, poll_s=0.5)
        counts = record["document_counts"]
        if counts["ready"] != len(qa) + n_distractors:
            raise RuntimeError(f"the collection is not ready: {counts}")
        qa_only = create_collection(http, "qa")  # the same documents without distractors: what they alone cost
        checked(http.post(f"/v1/collections/{qa_only}/documents", json={"document_ids": ids}), 200)
        wait_collection(http, qa_only, poll_s=0.5)
        qa_ids = set(ids)
        decode = services.target.tokenizer.decode
        named: list[Judged] = []
        over: dict[str, list[Judged]] = {cid: [], qa_only: []}
        context: set[str] = set()
        consistent = True
        for doc, doc_id in zip(qa, ids, strict=True):
            stored = services.store.load_text(doc_id)
            for q in doc.questions:
                span = (q.answer_start, q.answer_end) if stored == doc.text else locate(stored, q.answer_passage)
                queries = retrieval_queries(q.question, ())
                ask = Question(question=q.question, document_ids=[doc_id], max_tokens=ASK_TOKENS,
                               sampling=SamplingParams())
                pattern = passage_pattern(q.answer_passage)
                p = plan(services, admit(services, DEFAULT_TENANT, ask))
                ranking = services.retriever.rank(queries, [doc_id], tenant=DEFAULT_TENANT)
                named.append(judge(p.sources, ranking.hits, doc_id, span, q.held_out, qa_ids))
                named[-1].in_prompt = pattern.search(decode(list(p.prompt.ids))) is not None
                for collection_id, judged in over.items():
                    ask = Question(question=q.question, document_ids=[], max_tokens=ASK_TOKENS,
                                   sampling=SamplingParams(), collection_ids=[collection_id])
                    admission = admit(services, DEFAULT_TENANT, ask)
                    p = plan(services, admission)
                    scope = admission.scope
                    whole = scope is not None and scope.whole
                    if collection_id == cid:
                        context.add("documents" if whole else "chunks")
                    ranking = services.retriever.rank(queries, [r.id for r in admission.records],
                                                      tenant=DEFAULT_TENANT) \
                        if whole else _rank_library(services, admission, queries, None)
                    judged.append(judge(p.sources, ranking.hits, doc_id, span, q.held_out, qa_ids))
                    judged[-1].in_prompt = pattern.search(decode(list(p.prompt.ids))) is not None
                    best = ranking.relevant().hits
                    if p.sources and best:
                        top = max(best, key=lambda h: h.score)
                        consistent &= (p.sources[0].document_id, p.sources[0].start) == (top.document_id, top.start)
        window = services.prompts.max_context
    result = {
        "qa_documents": [d.doc_id for d in qa], "questions": len(named),
        "held_out_questions": sum(j.held_out for j in named), "distractors": n_distractors,
        "distractor_corpus": "bench.library (PSF licence), spread evenly over the ingested library",
        "collection": {k: record[k] for k in ("document_counts", "chunks", "tokens")}, "window": window,
        "collection_context": sorted(context),
        "named": summarise(named), "named_held_out": summarise([j for j in named if j.held_out]),
        "collection_asked": summarise(over[cid]),
        "collection_held_out": summarise([j for j in over[cid] if j.held_out]),
        "qa_collection_asked": summarise(over[qa_only]),
        "qa_collection_held_out": summarise([j for j in over[qa_only] if j.held_out]),
        "sources_match_ranking": consistent,
        "notes": [
            "sources: app.answering.pipeline.plan's (what /v1/ask shows), best first; the evidence: a source whose "
            "span overlaps the question's answer passage in its own document.",
            "evidence_in_prompt: questions whose whole answer passage is in the target's prompt (a named document "
            "past the window and a collection past it: the best chunks that fit the long-document budget).",
            "evidence_rank: the best evidence chunk's rank by score in the ranking plan cuts the sources from: every "
            "chunk of the named document (Retriever.rank), or the collection's candidates (Retriever.rank_library, "
            "as pipeline._rank_library calls it); evidence_not_ranked: not among the candidates.",
            "qa_collection_asked: the same questions over a second collection of the QA documents alone (no "
            "distractor): what the QA documents cost each other (five licences answer many of the same questions) "
            "beside what the distractors add.",
            "a server in this process with the KV cache off (RAGSPEC_KV_CACHE_BYTES=0: no generation runs here, so "
            "no warm-up competes); retrieval settings as shipped.",
        ],
    }
    for name, held in (("named", "named_held_out"), ("collection_asked", "collection_held_out"),
                       ("qa_collection_asked", "qa_collection_held_out")):
        s, h = result[name], result[held]
        out(f"  {name:17s}: best source holds the evidence {s['best_source_holds_evidence']}/{s['questions']}, in "
            f"sources {s['evidence_in_sources']}, evidence rank mean {s['evidence_rank_mean']}, not ranked "
            f"{s['evidence_not_ranked']}, in the prompt {s['evidence_in_prompt']}; held out "
            f"{h['best_source_holds_evidence']}/{h['questions']}")
    return result


# ---- ttft -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmallDoc:
    name: str
    upload: Upload
    questions: tuple[str, ...]
    tokens: int


def small_documents(tokenizer: Any, room: int, n: int, library: Sequence[LibraryDoc]) -> list[SmallDoc]:
    """``n`` documents that fit ``room`` target tokens together: the smallest QA documents first (their questions),
    then the largest library documents that still fit (questions on their subject)."""
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    chosen: list[SmallDoc] = []
    used = 0
    for d in sorted(load_qa(), key=lambda d: len(d.text)):
        t = count(d.text) + 16
        if len(chosen) < n - 1 and used + t <= room and len(d.questions) >= 2:
            chosen.append(SmallDoc(d.doc_id, Upload(d.filename, d.text), tuple(q.question for q in d.questions), t))
            used += t
    sized = sorted(((count(d.text) + 16, i) for i, d in enumerate(library)), reverse=True)
    for t, i in sized:
        if len(chosen) >= n:
            break
        if used + t <= room:
            lib = library[i]
            subject = lib.title.split(" (part")[0]
            questions = (f"What is {subject} for?", f"Which functions or classes does {subject} provide?",
                         f"What arguments does {subject} take?", f"What does {subject} return?")
            chosen.append(SmallDoc(lib.title, Upload(f"{subject[:60]}.txt", lib.text), questions, t))
            used += t
    return chosen


def ask_stream(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed ``/v1/ask``: wall seconds to the first ``token`` event and to the end, and the stats."""
    t = time.perf_counter()
    first = None
    stats: dict[str, Any] = {}
    done: dict[str, Any] = {}
    event = ""
    with http.stream("POST", "/v1/ask", json={**body, "stream": True, "max_tokens": ASK_TOKENS}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"/v1/ask: {r.status_code} {r.text[:500]}")
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if event == "token" and first is None:
                    first = time.perf_counter() - t
                elif event == "stats":
                    stats = json.loads(data)
                elif event == "done":
                    done = json.loads(data)
                elif event == "error":
                    raise RuntimeError(f"/v1/ask failed in band: {data}")
    if first is None:
        raise RuntimeError("the stream had no token")
    return {"first_token_s": round(first, 4), "ttft_ms": stats.get("ttft_ms"),
            "total_s": round(time.perf_counter() - t, 4),
            "prompt_tokens": done.get("usage", {}).get("prompt_tokens"),
            "prefix_reused_tokens": stats.get("prefix_reused_tokens"), "context": stats.get("context"),
            "documents": stats.get("documents")}


def wait_idle(services: Any) -> None:
    """Until no document indexes, the collections' background work (one worker, in order: a no-op queued behind it
    has run) is done and no KV warm-up runs or waits."""
    def idle() -> bool:
        scheduler = services.scheduler
        return (services.indexing.pending == 0 and not getattr(scheduler, "_background", ())
                and getattr(scheduler, "_running_background", None) is None and scheduler.running_count == 0)

    background = getattr(services, "background", None)
    for _ in range(2):
        wait_for(idle, "the server's background work", deadline_s=DEADLINE_S, every_s=0.2)
        if background is not None:
            background.submit(lambda: None).result(timeout=DEADLINE_S)
        time.sleep(0.3)
    wait_for(idle, "the server's background work", deadline_s=DEADLINE_S, every_s=0.2)


def forget(services: Any, doc_ids: Sequence[str]) -> None:
    """Drop every KV prefix holding these documents (``Services.forget_document``): their next question is cold."""
    if services.prefix_cache is not None:
        services.prefix_cache.flush()
    for doc_id in doc_ids:
        services.forget_document(doc_id)


def _spread(values: Sequence[float]) -> float | None:
    return round((max(values) - min(values)) / median(values), 4) if len(values) > 1 and median(values) else None


def _ttft_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    wall = [r["first_token_s"] * 1000 for r in rows]
    stat = [r["ttft_ms"] for r in rows]
    rate = [r["prompt_tokens"] / (r["ttft_ms"] / 1000) for r in rows if r["prompt_tokens"] and r["ttft_ms"]]
    return {"prompt_tokens_per_s_median": round(median(rate), 1), "prompt_tokens_per_s_spread": _spread(rate),
            "n": len(rows), "first_token_ms_median": round(median(wall), 1), "ttft_ms_median": round(median(stat), 1),
            "ttft_ms": [round(x, 1) for x in stat], "first_token_ms": [round(x, 1) for x in wall],
            "spread": _spread(stat), "prompt_tokens_median": median([r["prompt_tokens"] for r in rows]),
            "prefix_reused_tokens": [r["prefix_reused_tokens"] for r in rows]}


def fits_window(services: Any, url: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """Part 1: a collection the target reads whole, against its documents one at a time, cold and warm."""
    from app.answering.pipeline import WHOLE_SLACK

    window = services.prompts.max_context
    room = window - ASK_TOKENS - WHOLE_SLACK - 64  # the template, titles and the question
    library = ensure_library(args)
    docs = small_documents(tokenizer, room, args.ttft_docs, library.docs)
    out(f"  fits the window ({window}): {[d.name for d in docs]}, {sum(d.tokens for d in docs)} tokens")
    with client(url) as http:
        cid = create_collection(http, "fits the window")
        ids, _ = upload_files(http, [d.upload for d in docs], cid)
        record, _ = wait_collection(http, cid, poll_s=0.2)
        wait_idle(services)
        forget(services, ids)
        rounds: list[dict[str, Any]] = []
        code = ask_stream(http, {"question": docs[0].questions[-1], "collection_ids": [cid]})  # code paths warmed
        for r in range(args.ttft_rounds):
            j = r % len(docs)
            pair = r // len(docs)
            qs = docs[j].questions
            cold_q, warm_q = qs[(2 * pair) % len(qs)], qs[(2 * pair + 1) % len(qs)]
            row: dict[str, Any] = {"document": docs[j].name, "cold_question": cold_q, "warm_question": warm_q}
            order = ("collection", "one") if r % 2 == 0 else ("one", "collection")
            for kind in order:
                scope = {"collection_ids": [cid]} if kind == "collection" else {"document_ids": [ids[j]]}
                wait_idle(services)
                forget(services, ids)
                cold = ask_stream(http, {"question": cold_q, **scope})
                warm = ask_stream(http, {"question": warm_q, **scope})
                row[kind] = {"cold": cold, "warm": warm}
                out(f"    round {r} {kind:10s} ({docs[j].name}): cold {cold['ttft_ms']:.0f} ms "
                    f"({cold['prompt_tokens']} tokens, {cold['prefix_reused_tokens']} reused), warm "
                    f"{warm['ttft_ms']:.0f} ms ({warm['prefix_reused_tokens']} reused)")
            rounds.append(row)
        forget(services, ids)
    summary = {f"{kind}_{temp}": _ttft_summary([r[kind][temp] for r in rounds])
               for kind in ("collection", "one") for temp in ("cold", "warm")}
    cold_ok = all(r[k]["cold"]["prefix_reused_tokens"] == 0 for r in rounds for k in ("collection", "one"))
    return {
        "window": window, "documents": [{"name": d.name, "tokens": d.tokens} for d in docs],
        "collection": {k: record[k] for k in ("document_counts", "chunks", "tokens")},
        "contexts": sorted({r[k][t]["context"] for r in rounds for k in ("collection", "one")
                            for t in ("cold", "warm")}),
        "rounds": rounds, "code_warm_up": code, **summary,
        "collection_over_one_cold": round(summary["collection_cold"]["ttft_ms_median"]
                                          / max(summary["one_cold"]["ttft_ms_median"], 1e-9), 3),
        "collection_over_one_warm": round(summary["collection_warm"]["ttft_ms_median"]
                                          / max(summary["one_warm"]["ttft_ms_median"], 1e-9), 3),
        "cold_really_cold": cold_ok,
    }


def _index_ops(services: Any, collection_id: str, query: str, candidates: int) -> dict[str, float]:
    """Seconds of each index call ``rank_library`` makes for one query (nearest chunk vectors, BM25 candidates, the
    terms' statistics), made outside it, and their sum (``total``)."""
    from retrieval.lexical import terms

    vector = services.embedder.encode_query(query)
    ts = terms(query)
    took = {"search": 0.0, "lexical": 0.0, "term_stats": 0.0}
    with services.library.synced(collection_id) as index:
        took["search"] = _timed(index.search, vector, candidates, None)
        if services.retriever.lexical_weight > 0:
            took["lexical"] = _timed(index.lexical, ts, candidates, None)
            took["term_stats"] = _timed(index.term_stats, {w: 0 for w in ts})
    return {**took, "total": sum(took.values())}


def library_phase(services: Any, http: httpx.Client, collection_id: str, questions: Sequence[str],
                  repeats: int) -> dict[str, Any]:
    """Each question: ``rank_library`` as the pipeline calls it (first call, then the median of ``repeats``), the
    index's own calls, the plan (retrieval + prompt), then the question over HTTP (TTFT) and again (its prompt
    cached)."""
    from app.answering.pipeline import DEFAULT_CANDIDATES, Question, _rank_library, admit, plan
    from decoding.speculative.generation import SamplingParams
    from retrieval.store import DEFAULT_TENANT

    rows = []
    for q in questions:
        ask = Question(question=q, document_ids=[], max_tokens=ASK_TOKENS, sampling=SamplingParams(),
                       collection_ids=[collection_id])
        admission = admit(services, DEFAULT_TENANT, ask)
        assert admission.scope is not None
        timings = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            ranking = _rank_library(services, admission, [q], None)
            timings.append(time.perf_counter() - t)
        retriever = services.retriever  # its cache of loaded documents, against the candidates' documents
        cached = [d for d in ranking.doc_ids if d in retriever._cache]
        counts = admission.scope.counts
        chunk_tokens = max(1, counts.tokens // max(counts.chunks, 1))
        candidates = max(DEFAULT_CANDIDATES, 2 * services.prompts.max_context // chunk_tokens)
        ops = [_index_ops(services, collection_id, q, candidates) for _ in range(repeats)]
        index_s = median([o["total"] for o in ops])
        embed_s = median([_timed(services.embedder.encode_query, q) for _ in range(repeats)])
        plan_s = median([_timed(plan, services, admission) for _ in range(max(1, repeats // 2))])
        first = ask_stream(http, {"question": q, "collection_ids": [collection_id]})
        again = ask_stream(http, {"question": q, "collection_ids": [collection_id]})
        retrieval_ms = median(timings[1:]) * 1000
        rows.append({
            "question": q, "candidates_asked": candidates, "ranked_chunks": len(ranking.hits),
            "ranked_documents": len(ranking.doc_ids), "whole": admission.scope.whole,
            "rank_library_first_ms": round(timings[0] * 1000, 2), "rank_library_ms": round(retrieval_ms, 2),
            "retriever_cache_bytes": retriever.cache_bytes, "candidate_documents_cached": len(cached),
            "index_calls_ms": round(index_s * 1000, 2), "query_embedding_ms": round(embed_s * 1000, 2),
            "index_call_ms": {k: round(median([o[k] for o in ops]) * 1000, 2) for k in ("search", "lexical",
                                                                                       "term_stats")},
            "fine_scoring_ms": round(max(retrieval_ms - (index_s + embed_s) * 1000, 0.0), 2),
            "plan_ms": round(plan_s * 1000, 2), "ask": first, "ask_again": again,
            "retrieval_share_of_ttft": round(retrieval_ms / first["ttft_ms"], 5),
            "retrieval_share_of_repeat_ttft": round(retrieval_ms / again["ttft_ms"], 5),
        })
        out(f"    {q[:48]:48s} rank_library {retrieval_ms:7.1f} ms (first {timings[0] * 1000:.0f}, index "
            f"{index_s * 1000:.1f}), TTFT {first['ttft_ms']:.0f} ms ({first['prompt_tokens']} tokens), again "
            f"{again['ttft_ms']:.0f} ms: share {rows[-1]['retrieval_share_of_ttft']:.2%}")
    share = [r["retrieval_share_of_ttft"] for r in rows]
    return {"questions": rows, "rank_library_ms_median": round(median([r["rank_library_ms"] for r in rows]), 2),
            "rank_library_first_ms_median": round(median([r["rank_library_first_ms"] for r in rows]), 2),
            "index_calls_ms_median": round(median([r["index_calls_ms"] for r in rows]), 2),
            "index_call_ms_median": {k: round(median([r["index_call_ms"][k] for r in rows]), 2)
                                     for k in ("search", "lexical", "term_stats")},
            "fine_scoring_ms_median": round(median([r["fine_scoring_ms"] for r in rows]), 2),
            "plan_ms_median": round(median([r["plan_ms"] for r in rows]), 2),
            "ttft_ms_median": round(median([r["ask"]["ttft_ms"] for r in rows]), 1),
            "repeat_ttft_ms_median": round(median([r["ask_again"]["ttft_ms"] for r in rows]), 1),
            "retrieval_share_median": round(median(share), 5), "retrieval_share_max": round(max(share), 5),
            "retrieval_share_of_repeat_median": round(median([r["retrieval_share_of_repeat_ttft"] for r in rows]), 5)}


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def pad_index(services: Any, collection_id: str, total_chunks: int, seed: int = 0) -> dict[str, Any]:
    """Synthetic documents added to the collection's index up to ``total_chunks`` chunk vectors (see the module
    docstring), its synced version then set to the catalogue's so the next sync keeps them."""
    from retrieval.collection_index import DocumentEntry, chunk_vectors
    from retrieval.lexical import terms

    store, embedder = services.store, services.embedder
    real_vectors, real_terms = [], []
    for record in store.members([collection_id], statuses=["ready"]):
        chunks = store.load_chunks(record.id)
        passages = store.load_passages(record.id)
        windows = store.load_index(record.id, embedder).vectors()
        owners = np.arange(len(chunks)) if passages is None else passages[:, 0].astype(np.int64)
        real_vectors.append(chunk_vectors(windows, owners, len(chunks)))
        real_terms += [terms(c.text) for c in chunks]
    base = np.concatenate(real_vectors)
    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    with services.library.synced(collection_id) as index:
        have = index.n_live
        added_docs = 0
        while have < total_chunks:
            n = min(PAD_CHUNKS_PER_DOC, total_chunks - have)
            pick = rng.integers(0, len(base), n)
            noise = rng.standard_normal((n, base.shape[1])).astype(np.float32)
            noise *= PAD_NOISE / np.linalg.norm(noise, axis=1, keepdims=True)
            vectors = base[pick] + noise
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            entry = DocumentEntry(np.ascontiguousarray(vectors, dtype=np.float32),
                                  [real_terms[int(i)] for i in rng.integers(0, len(real_terms), n)])
            index.add(f"pad{added_docs:06d}", 0.0, entry)
            have += n
            added_docs += 1
        version = store.collection_versions([collection_id])[collection_id]
        index.set_synced_version(version)
        kind, n_vectors = index.kind, index.n_vectors
    seconds = time.perf_counter() - t
    with services.library.synced(collection_id) as index:  # the sync keeps them
        kept = index.n_vectors
    return {"real_chunks": len(base), "padding_documents": added_docs,
            "chunks_per_padding_document": PAD_CHUNKS_PER_DOC, "vectors": n_vectors, "vectors_after_sync": kept,
            "index_kind": kind, "add_s": round(seconds, 2)}


def run_ttft(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    library = ensure_library(args)
    result: dict[str, Any] = {"ask_max_tokens": ASK_TOKENS, "rounds": args.ttft_rounds}
    out(f"ttft: a collection within the window, {args.ttft_rounds} rounds; then the library past it")
    with thread_server(library.data_dir, kv_cache_persist=False, max_context=args.server_max_context) as server, \
            client(server.url) as http:
        services = server.services
        result["server_start_s"] = round(server.start_s, 2)
        tokenizer = services.target.tokenizer
        result["fits_window"] = fits_window(services, server.url, args, tokenizer)
        save(result)
        fit = result["fits_window"]
        out(f"  within the window: collection cold {fit['collection_cold']['ttft_ms_median']:.0f} / warm "
            f"{fit['collection_warm']['ttft_ms_median']:.0f} ms; one document cold "
            f"{fit['one_cold']['ttft_ms_median']:.0f} / warm {fit['one_warm']['ttft_ms_median']:.0f} ms")
        cid = library.collection_id
        k = args.ttft_library_questions
        questions = list(LIBRARY_QUESTIONS)
        past: dict[str, Any] = {"collection": {k2: v for k2, v in checked(http.get(f"/v1/collections/{cid}"), 200)
                                               .items() if k2 in ("document_counts", "chunks", "tokens")}}
        out(f"  the library past the window: {past['collection']}")
        past["as_ingested"] = library_phase(services, http, cid, questions[:k], args.ttft_repeats)
        save(result | {"past_window": past})
        past["padding"] = pad_index(services, cid, args.ttft_pad_chunks)
        out(f"  padded to {past['padding']['vectors']} chunk vectors ({past['padding']['index_kind']}) in "
            f"{past['padding']['add_s']:.1f} s")
        past["padded"] = library_phase(services, http, cid, questions[k:2 * k], args.ttft_repeats)
        pad = past["padded"]
        ingested = past["as_ingested"]
        estimate = pad["rank_library_ms_median"] + max(
            ingested["fine_scoring_ms_median"] - pad["fine_scoring_ms_median"], 0.0)
        # a real 100K-chunk library fills the prompt's budget as the ingested one does: its TTFT is the ingested
        # question's with this retrieval in place of the measured one
        ttft_100k = ingested["ttft_ms_median"] - ingested["rank_library_ms_median"] + estimate
        repeat_100k = ingested["repeat_ttft_ms_median"] - ingested["rank_library_ms_median"] + estimate
        past["estimate_100k_ms"] = round(estimate, 2)
        past["estimate_100k_ttft_ms"] = round(ttft_100k, 1)
        past["estimate_100k_share"] = round(estimate / ttft_100k, 5)
        past["estimate_100k_share_of_repeat"] = round(estimate / repeat_100k, 5)
        past["goal"] = {"max_retrieval_share": GOAL_RETRIEVAL_SHARE,
                        "met": max(pad["retrieval_share_median"], past["estimate_100k_share"]) <= GOAL_RETRIEVAL_SHARE,
                        "judged_on": "a new question's TTFT (its prompt's KV not cached): the padded share and the "
                                     "100K estimate"}
        past["notes"] = [
            "rank_library_ms: Retriever.rank_library as plan calls it (pipeline._rank_library, the candidates it "
            "asks for), timed in this process after a first call (rank_library_first_ms: the retriever's document "
            "cache cold); the TTFT (stats.ttft_ms, from the request's arrival) is of the same question over HTTP, "
            "asked once (ask) and again with its prompt's KV cached (ask_again). "
            "ranked_documents: the candidates' documents; candidate_documents_cached: those the retriever's cache "
            "of loaded documents (retriever_cache_bytes, least recently asked dropped first) held after the timings.",
            "padded: synthetic documents' chunk vectors (a real chunk's vector plus noise, a real chunk's terms) "
            "added with CollectionIndex.add under fake ids, the synced version set to the catalogue's current one. "
            "The store does not know them, so rank_library skips their candidates at fine scoring: the padded "
            "rank_library times the index at that size and the fine scoring of the real candidates left; "
            "estimate_100k_ms adds back the fine scoring the padding's candidates displaced (as_ingested's minus "
            "padded's). The padded questions' prompts are short (the few real candidates left), so their TTFT is "
            "too: estimate_100k_ttft_ms is the ingested questions' TTFT with the estimated retrieval in place of "
            "theirs (a real 100K-chunk library fills the prompt's budget as the ingested one does), "
            "estimate_100k_share the estimate's share of it, estimate_100k_share_of_repeat of a repeated "
            "question's.",
        ]
        result["past_window"] = past
        out(f"  retrieval share of TTFT: as ingested {past['as_ingested']['retrieval_share_median']:.2%}, padded "
            f"{pad['retrieval_share_median']:.2%}, 100K estimate {estimate:.0f} ms of {ttft_100k:.0f} "
            f"({past['estimate_100k_share']:.2%}; of a repeated question "
            f"{past['estimate_100k_share_of_repeat']:.0%}); goal {'met' if past['goal']['met'] else 'NOT met'}")
    result["notes"] = [
        "a server in this process (uvicorn in a thread, RAGSPEC_KV_CACHE_PERSIST=false, calibration off); questions "
        f"streamed over /v1/ask with max_tokens={ASK_TOKENS}; first_token_ms: the client's wall time to the first "
        "token event, ttft_ms: the server's stats.ttft_ms (from the request's arrival).",
        "cold: after the upload's warm-ups finished, every KV prefix holding the documents was dropped "
        "(Services.forget_document), so the prompt is prefilled whole (prefix_reused_tokens 0); warm: a second, "
        "different question on the same scope; the code paths were warmed by one question first (code_warm_up).",
        "spread: (max - min) / median over the rounds.",
    ]
    return result


# ---- registration ---------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the ingest, quality and ttft sections (added once, with ingest's)."""
    g = p.add_argument_group("ingest, quality, ttft (bench/collections_service.py)")
    g.add_argument("--library-docs", type=int, default=1200, help="library documents (bench.library)")
    g.add_argument("--upload-batch", type=int, default=50, help="files per upload request")
    g.add_argument("--ingest-variants", type=lambda s: [v for v in s.split(",") if v],
                   default=list(INGEST_VARIANTS), help=f"of {', '.join(INGEST_VARIANTS)}; the first is the headline")
    g.add_argument("--poll-s", type=float, default=POLL_S, help="collection polling interval")
    g.add_argument("--server-max-context", type=int, default=None, help="RAGSPEC_MAX_CONTEXT (default: the model's)")
    g.add_argument("--quality-docs", type=int, default=0, help="QA documents, smallest first (0: all)")
    g.add_argument("--quality-distractors", type=int, default=200)
    g.add_argument("--ttft-docs", type=int, default=3)
    g.add_argument("--ttft-rounds", type=int, default=6)
    g.add_argument("--ttft-library-questions", type=int, default=3, help="per phase (as ingested, padded)")
    g.add_argument("--ttft-repeats", type=int, default=5, help="rank_library timings per question")
    g.add_argument("--ttft-pad-chunks", type=int, default=100_000)
