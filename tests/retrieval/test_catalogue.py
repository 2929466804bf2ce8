"""The catalogue on its two backends, SQLite (the embedded default) and a real PostgreSQL (on a loopback port): the
same rows, order, updates and errors; the schema made by the migrations on a fresh database; a SQLite store made
before the migrations existed adopted with its rows; an unreachable database a clear error that hides its password;
a whole document ingested through a store whose catalogue is PostgreSQL; ingestion jobs claimed once, their leases
renewed, taken over when they run out, given up after too many attempts."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from retrieval.catalogue import Catalogue, Claim, DocumentRecord
from retrieval.embedding import Embedder
from retrieval.errors import CatalogueUnavailable, DocumentNotFound, IngestAbandoned
from retrieval.store import DocumentStore
from tests.conftest import PostgresServer, free_port


def record(i: int, tenant: str = "t1", status: str = "queued") -> DocumentRecord:
    return DocumentRecord(
        id=f"doc{i:02d}", tenant=tenant, title=f"Title {i}", filename=f"f{i}.txt", content_type="text/plain",
        kind="txt", size=100 + i, status=status, progress=0.0, message=None, n_chunks=0, n_tokens=0,  # type: ignore[arg-type]
        embedder=None, created_at=1000.0 + i, updated_at=1000.0 + i,
    )  # fmt: skip


@pytest.fixture(params=["sqlite", "postgresql"])
def catalogue(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        cat = Catalogue(tmp_path / "store.sqlite3")
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        cat = Catalogue(server.create_database(f"cat_{uuid.uuid4().hex[:8]}"))
    assert cat.backend == request.param
    yield cat
    cat.close()


def test_rows_order_updates_and_deletes_are_the_same_on_both_backends(catalogue: Catalogue) -> None:
    for i in (3, 1, 2):
        catalogue.insert(record(i, tenant="t1" if i != 2 else "t2"))
    assert catalogue.row("doc01") == record(1)
    assert catalogue.row("nope") is None
    assert catalogue.ids() == ["doc01", "doc02", "doc03"]  # oldest first
    assert [r.id for r in catalogue.list("t1")] == ["doc01", "doc03"]
    assert [r.id for r in catalogue.list(None)] == ["doc01", "doc02", "doc03"]
    catalogue.update("doc02", status="ready", progress=1.0, n_chunks=7, n_tokens=123_456_789_012, embedder="m")
    row = catalogue.row("doc02")
    assert row is not None
    assert (row.status, row.progress, row.n_chunks, row.n_tokens) == ("ready", 1.0, 7, 123_456_789_012)
    assert row.updated_at > row.created_at
    assert catalogue.ids(("ready",)) == ["doc02"] and catalogue.ids(("queued", "indexing")) == ["doc01", "doc03"]
    with pytest.raises(DocumentNotFound):
        catalogue.update("nope", status="ready")
    catalogue.delete("doc01")
    assert catalogue.ids() == ["doc02", "doc03"]
    with pytest.raises(sa.exc.IntegrityError):  # an id is taken once
        catalogue.insert(record(2))


def test_a_fresh_database_gets_the_schema_at_the_newest_revision(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("fresh")
    Catalogue(url).close()
    Catalogue(url).close()  # opening again migrates nothing and loses nothing
    engine = sa.create_engine("postgresql+psycopg://" + url.split("://", 1)[1])
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() == "0004"
        columns = {c["name"] for c in sa.inspect(conn).get_columns("documents")}
        indexes = {i["name"] for i in sa.inspect(conn).get_indexes("documents")}
    engine.dispose()
    assert {"id", "tenant", "status", "n_tokens", "created_at", "purpose"} <= columns and "documents_tenant" in indexes


def test_a_store_made_before_the_migrations_is_adopted_with_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    old = sqlite3.connect(path)  # the table as the SQLite-only catalogue made it
    old.executescript("""
        CREATE TABLE documents (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, title TEXT NOT NULL, filename TEXT,
            content_type TEXT, kind TEXT NOT NULL, size INTEGER NOT NULL, status TEXT NOT NULL,
            progress REAL NOT NULL DEFAULT 0, message TEXT, n_chunks INTEGER NOT NULL DEFAULT 0,
            n_tokens INTEGER NOT NULL DEFAULT 0, embedder TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE INDEX documents_tenant ON documents (tenant, created_at);
        INSERT INTO documents VALUES ('doc07', 't1', 'Title 7', 'f7.txt', 'text/plain', 'txt', 107, 'queued', 0, NULL,
            0, 0, NULL, 1007.0, 1007.0);
    """)
    old.close()
    cat = Catalogue(path)
    assert cat.row("doc07") == record(7)
    cat.insert(record(8))
    assert cat.ids() == ["doc07", "doc08"]
    cat.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == ("0004",)
        assert conn.execute("SELECT count(*) FROM ingest_jobs").fetchone() == (0,)


def test_an_unreachable_database_is_a_clear_error_without_its_password() -> None:
    url = f"postgresql://ragspec:s3cret@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises(CatalogueUnavailable) as info:
        Catalogue(url)
    message = str(info.value)
    assert "unreachable" in message and "127.0.0.1" in message and "s3cret" not in message
    with pytest.raises(CatalogueUnavailable, match="cannot be used"):
        Catalogue("nosuchdb://x")


def test_a_store_ingests_with_its_catalogue_in_postgresql(tmp_path: Path, postgres_server: PostgresServer,
                                                          target_tokenizer: Any, minilm: Embedder) -> None:
    url = postgres_server.create_database("store")
    store = DocumentStore(tmp_path / "store", database=url)
    text = b"The lighthouse keeper climbs the stairs at dusk. " * 20
    rec = store.create("t1", "Keeper", "keeper.txt", "text/plain", text)
    ready = store.ingest(rec.id, target_tokenizer, minilm, chunk_tokens=32)
    assert ready.status == "ready" and ready.n_chunks > 0
    store.close()
    again = DocumentStore(tmp_path / "store", database=url)  # a restart (or another replica) reads the same rows
    assert again.recover().failed == []
    assert [r.id for r in again.list("t1")] == [rec.id] and again.get(rec.id).status == "ready"
    assert not (tmp_path / "store" / "store.sqlite3").exists()
    again.close()


def test_an_ingestion_job_is_claimed_once_and_taken_over_when_its_lease_runs_out(catalogue: Catalogue) -> None:
    for i in (1, 2):
        catalogue.insert(record(i))
        catalogue.add_job(f"doc{i:02d}")
    catalogue.add_job("doc01")  # queued twice: still one job
    assert catalogue.jobs() == [("doc01", None, 0), ("doc02", None, 0)]
    first = catalogue.claim("w1", 60.0, 3)
    assert first == Claim("doc01", "w1", 1)
    assert catalogue.claim("w2", 60.0, 3, "doc01") is None  # held
    assert catalogue.claim("w2", 0.2, 3) == Claim("doc02", "w2", 1)  # the next one
    assert catalogue.claim("w3", 60.0, 3) is None
    assert catalogue.renew(first, 60.0)
    time.sleep(0.3)  # w2's lease runs out: w2 died
    taken = catalogue.claim("w3", 60.0, 3)
    assert taken == Claim("doc02", "w3", 2)
    assert not catalogue.renew(Claim("doc02", "w2", 1), 60.0)  # the dead worker's claim no longer holds
    catalogue.finish(Claim("doc02", "w2", 1))  # nor can it finish the job
    assert [j[0] for j in catalogue.jobs()] == ["doc01", "doc02"]
    catalogue.finish(taken)
    catalogue.finish(first)
    assert catalogue.jobs() == []


def test_a_job_is_given_up_after_its_attempts_and_dropped_with_its_document(catalogue: Catalogue) -> None:
    catalogue.insert(record(1))
    catalogue.add_job("doc01")
    for attempt in (1, 2):
        assert catalogue.claim(f"w{attempt}", 0.0, 2) == Claim("doc01", f"w{attempt}", attempt)
        time.sleep(0.01)
    assert catalogue.claim("w3", 60.0, 2, gave_up="cut twice") == "doc01"  # cut twice: the document fails
    assert catalogue.jobs() == []
    failed = catalogue.row("doc01")
    assert failed is not None and (failed.status, failed.message) == ("failed", "cut twice")
    catalogue.insert(record(2))
    catalogue.add_job("doc02")
    catalogue.update("doc02", status="ready")  # finished by a worker that died before deleting its job
    catalogue.insert(record(3))
    catalogue.add_job("doc03")
    catalogue.delete("doc03")
    assert catalogue.claim("w1", 60.0, 2) is None and catalogue.jobs() == []


def test_a_document_inserted_with_its_job_and_waiting_ones_given_theirs(catalogue: Catalogue) -> None:
    catalogue.insert(record(1), job=True)
    assert catalogue.jobs() == [("doc01", None, 0)]
    catalogue.insert(record(2))  # queued before jobs existed
    catalogue.insert(record(3, status="ready"))
    assert catalogue.add_missing_jobs() == ["doc02"]
    assert [j[0] for j in catalogue.jobs()] == ["doc01", "doc02"]
    assert catalogue.add_missing_jobs() == []


def test_workers_racing_for_jobs_hold_each_one_once(catalogue: Catalogue) -> None:
    for i in range(12):
        catalogue.insert(record(i))
        catalogue.add_job(f"doc{i:02d}")
    held: list[Claim] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        while (claim := catalogue.claim(name, 60.0, 3)) is not None:
            assert isinstance(claim, Claim)
            with lock:
                held.append(claim)

    threads = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(c.doc_id for c in held) == [f"doc{i:02d}" for i in range(12)]


def test_an_ingest_whose_job_was_taken_over_drops_its_work(tmp_path: Path, target_tokenizer: Any,
                                                           minilm: Embedder) -> None:
    store = DocumentStore(tmp_path / "store")
    rec = store.create("t1", "Keeper", "keeper.txt", "text/plain", b"The keeper climbs the stairs at dusk. " * 20)
    with pytest.raises(IngestAbandoned):
        store.ingest(rec.id, target_tokenizer, minilm, chunk_tokens=32, holds=lambda: False)
    after = store.get(rec.id)
    assert after.status == "indexing" and after.message != "failed"  # left to the worker holding the job now
    assert not (tmp_path / "store" / "docs" / rec.id / "derived").exists()
    assert list((tmp_path / "store" / "tmp").iterdir()) == []
    store.close()


def test_a_shared_store_starts_without_failing_others_ingests(tmp_path: Path) -> None:
    store = DocumentStore(tmp_path / "store")
    busy = store.create("t1", None, "a.txt", "text/plain", b"some text to keep")
    store._update(busy.id, status="indexing")  # another replica is ingesting it
    with store._lock:
        store._db.insert(record(7))  # queued before ingestion jobs existed: no job
    report = store.recover(shared=True)
    assert report.failed == [] and store.get(busy.id).status == "indexing"
    with store._lock:
        assert sorted(j[0] for j in store._db.jobs()) == sorted([busy.id, "doc07"])  # each will be taken
    store.close()


# ---- collections, attributes and filters -----------------------------------------------------------


def collection(cid: str, tenant: str = "t1", at: float = 2000.0) -> Any:
    from retrieval.catalogue import CollectionRecord

    return CollectionRecord(id=cid, tenant=tenant, name=f"name {cid}", description=None, metadata={"team": "a"},
                            version=0, created_at=at, updated_at=at)


def test_collections_membership_and_versions_on_both_backends(catalogue: Catalogue) -> None:
    for i in range(1, 5):
        catalogue.insert(record(i))
    catalogue.insert_collection(collection("c1"))
    catalogue.insert_collection(collection("c2", at=2001.0))
    catalogue.insert_collection(collection("c3", tenant="t2", at=2002.0))
    assert [c.id for c in catalogue.collections("t1")] == ["c1", "c2"]
    assert [c.id for c in catalogue.collections(None, limit=2, after="c1")] == ["c2", "c3"]
    assert catalogue.collections("t1", after="nope") == []
    assert catalogue.add_members("c1", ["doc01", "doc02", "doc01"]) == 2
    assert catalogue.add_members("c1", ["doc02", "doc03"]) == 1  # doc02 already in it
    assert catalogue.add_members("c2", ["doc02"]) == 1
    versions = catalogue.versions(["c1", "c2", "c3"])
    assert versions == {"c1": 2, "c2": 1, "c3": 0}
    assert catalogue.collections_of(["doc02", "doc04"]) == {"doc02": ["c1", "c2"], "doc04": []}
    catalogue.update("doc02", progress=0.5)  # progress alone: no new version
    assert catalogue.versions(["c1"]) == {"c1": 2}
    catalogue.update("doc02", status="ready", n_chunks=3, n_tokens=40)  # a status: every collection of it moves on
    assert catalogue.versions(["c1", "c2"]) == {"c1": 3, "c2": 2}
    counts = catalogue.member_counts(["c1"])
    assert counts.by_status == {"queued": 2, "ready": 1} and counts.total == 3
    assert (counts.chunks, counts.tokens, counts.ready_tokens, counts.bytes) == (3, 40, 40, 101 + 102 + 103)
    assert [r.id for r in catalogue.members(["c1", "c2"])] == ["doc01", "doc02", "doc03"]  # once each, oldest first
    assert [r.id for r in catalogue.members(["c1"], statuses=["ready"])] == ["doc02"]
    assert [r.id for r in catalogue.members(["c1"], limit=1, after="doc01")] == ["doc02"]
    assert list(catalogue.member_stamps(["c1"])) == ["doc02"]
    assert catalogue.remove_member("c1", "doc01") and not catalogue.remove_member("c1", "doc01")
    assert catalogue.versions(["c1"]) == {"c1": 4}
    catalogue.delete("doc02")  # a deleted document leaves its collections, which move on
    assert catalogue.versions(["c1", "c2"]) == {"c1": 5, "c2": 3}
    assert catalogue.member_counts(["c2"]).total == 0
    catalogue.update_collection("c1", name="renamed", metadata={"k": "v"})
    got = catalogue.collection("c1")
    assert got is not None and (got.name, got.metadata) == ("renamed", {"k": "v"})
    assert catalogue.delete_collection("c1") == ["doc03"]  # its members' ids; the documents stay
    assert catalogue.collection("c1") is None and catalogue.row("doc03") is not None
    assert catalogue.collections_of(["doc03"]) == {"doc03": []}


ATTRIBUTES: dict[str, dict[str, Any]] = {
    "doc01": {"year": 2024, "kind": "report", "final": True, "score": 0.5, "title": "Alpha"},
    "doc02": {"year": 2023, "kind": "contract", "final": False, "title": "beta"},
    "doc03": {"year": 2024.5, "kind": "Report", "title": "Été", "code": "1"},
    "doc04": {"kind": "memo", "code": 1},
    "doc05": {},
}
FILTERS: list[dict[str, Any]] = [
    {"type": "eq", "key": "year", "value": 2024},
    {"type": "ne", "key": "year", "value": 2024},
    {"type": "gt", "key": "year", "value": 2023},
    {"type": "gte", "key": "year", "value": 2023},
    {"type": "lt", "key": "year", "value": 2024.5},
    {"type": "lte", "key": "score", "value": 0.5},
    {"type": "eq", "key": "kind", "value": "report"},  # case matters
    {"type": "gt", "key": "title", "value": "Zeta"},  # code points: lower case and accents after upper case
    {"type": "lt", "key": "title", "value": "beta"},
    {"type": "eq", "key": "final", "value": True},
    {"type": "ne", "key": "final", "value": True},
    {"type": "eq", "key": "code", "value": 1},  # the number 1, not the string "1"
    {"type": "eq", "key": "code", "value": "1"},
    {"type": "in", "key": "kind", "value": ["memo", "contract", 7]},
    {"type": "nin", "key": "kind", "value": ["memo", "contract"]},
    {"type": "in", "key": "code", "value": [1, "1"]},
    {"type": "eq", "key": "nobody", "value": 1},
    {"type": "ne", "key": "nobody", "value": 1},
    {"type": "and", "filters": [{"type": "eq", "key": "year", "value": 2024},
                                {"type": "eq", "key": "final", "value": True}]},
    {"type": "or", "filters": [{"type": "eq", "key": "kind", "value": "memo"},
                               {"type": "and", "filters": [{"type": "gte", "key": "year", "value": 2024},
                                                           {"type": "nin", "key": "kind", "value": ["report"]}]}]},
]


def reference(f: dict[str, Any], attrs: dict[str, Any]) -> bool:
    """The filters' meaning, written plainly (retrieval/filters.py's docstring)."""
    if f["type"] in ("and", "or"):
        parts = [reference(g, attrs) for g in f["filters"]]
        return all(parts) if f["type"] == "and" else any(parts)
    if f["key"] not in attrs:
        return False
    have, want = attrs[f["key"]], f["value"]

    def kind(v: Any) -> str:
        return "b" if isinstance(v, bool) else "s" if isinstance(v, str) else "n"

    same = lambda v: kind(v) == kind(have) and v == have  # noqa: E731
    op = f["type"]
    if op == "in":
        return any(same(v) for v in want)
    if op == "nin":
        return not any(same(v) for v in want)
    if op == "eq":
        return same(want)
    if op == "ne":
        return not same(want)
    if kind(want) != kind(have):
        return False
    return {"gt": have > want, "gte": have >= want, "lt": have < want, "lte": have <= want}[op]


def test_filters_mean_the_same_on_both_backends(catalogue: Catalogue) -> None:
    from retrieval.filters import check_attributes, parse_filter

    for i in range(1, 6):
        catalogue.insert(record(i), attributes=check_attributes(ATTRIBUTES[f"doc0{i}"]))
    catalogue.insert_collection(collection("c1"))
    catalogue.add_members("c1", [f"doc0{i}" for i in range(1, 6)])
    assert catalogue.attributes(["doc01", "doc03", "doc05"]) == {
        "doc01": {"final": True, "kind": "report", "score": 0.5, "title": "Alpha", "year": 2024},
        "doc03": {"code": "1", "kind": "Report", "title": "Été", "year": 2024.5}, "doc05": {}}
    for raw in FILTERS:
        want = [d for d in sorted(ATTRIBUTES) if reference(raw, ATTRIBUTES[d])]
        got = [r.id for r in catalogue.members(["c1"], where=parse_filter(raw))]
        assert got == want, raw
    before = catalogue.versions(["c1"])["c1"]
    catalogue.set_attributes("doc05", {"kind": "memo"})
    assert catalogue.versions(["c1"])["c1"] == before + 1
    assert [r.id for r in catalogue.members(["c1"], where=parse_filter({"type": "eq", "key": "kind",
                                                                            "value": "memo"}))] == ["doc04", "doc05"]
    catalogue.set_attributes("doc05", {})
    assert catalogue.attributes(["doc05"]) == {"doc05": {}}
    with pytest.raises(DocumentNotFound):
        catalogue.set_attributes("nope", {})


def test_a_store_at_the_previous_revision_upgrades_in_place_and_loses_nothing(tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config

    from retrieval.catalogue import MIGRATIONS

    path = tmp_path / "store.sqlite3"
    engine = sa.create_engine(f"sqlite:///{path}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
        conn.execute(sa.text("INSERT INTO documents (id, tenant, title, kind, size, status, progress, n_chunks, "
                             "n_tokens, created_at, updated_at) VALUES ('doc07', 't1', 'Title 7', 'txt', 107, "
                             "'ready', 1, 3, 30, 1007.0, 1007.0)"))
        conn.execute(sa.text("INSERT INTO ingest_jobs (doc_id, attempts, created_at) VALUES ('doc08', 0, 1.0)"))
    engine.dispose()
    cat = Catalogue(path)  # 0002 -> 0003 -> 0004
    row = cat.row("doc07")
    assert row is not None and (row.title, row.status, row.n_tokens, row.purpose) == ("Title 7", "ready", 30, None)
    assert cat.jobs() == [("doc08", None, 0)]
    cat.insert_collection(collection("c1"))
    assert cat.add_members("c1", ["doc07"]) == 1 and cat.attributes(["doc07"]) == {"doc07": {}}
    cat.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == ("0004",)


def test_pages_batches_and_stored_responses_on_both_backends(catalogue: Catalogue) -> None:
    for i in (1, 2, 3, 4):
        catalogue.insert(replace(record(i), purpose="user_data" if i % 2 else None))
    assert [r.id for r in catalogue.page("t1", 10)] == ["doc01", "doc02", "doc03", "doc04"]
    assert [r.id for r in catalogue.page("t1", 2, newest_first=True)] == ["doc04", "doc03"]
    assert [r.id for r in catalogue.page("t1", 2, "doc03", newest_first=True)] == ["doc02", "doc01"]
    assert [r.id for r in catalogue.page("t1", 10, "doc02")] == ["doc03", "doc04"]
    assert [r.id for r in catalogue.page("t1", 10, purpose="user_data")] == ["doc01", "doc03"]
    assert catalogue.page("t1", 10, "unknown") == []
    for i, cid in enumerate(("c1", "c2", "c3")):
        catalogue.insert_collection(collection(cid, at=2000.0 + i))
    assert [c.id for c in catalogue.collections("t1", 2, newest_first=True)] == ["c3", "c2"]
    assert [c.id for c in catalogue.collections("t1", None, "c2", newest_first=True)] == ["c1"]
    catalogue.touch_collections(["c1"], 4242.0)
    c1 = catalogue.collection("c1")
    assert c1 is not None and c1.last_active_at == 4242.0 and c1.version == 0  # activity is not a change
    catalogue.update_collection("c1", expires_after_days=3)
    assert catalogue.collection("c1").expires_after_days == 3  # type: ignore[union-attr]

    assert catalogue.add_members("c1", ["doc01", "doc02", "doc03"]) == 3
    assert set(catalogue.added_at("c1", ["doc01", "doc04"])) == {"doc01"}
    catalogue.insert_batch("b1", "c1", ["doc02", "doc03"], 3000.0)
    batch = catalogue.batch("b1")
    assert batch is not None and (batch.doc_ids, batch.cancelled_ids, batch.cancelled_at) == (
        ("doc02", "doc03"), (), None)
    version = catalogue.versions(["c1"])["c1"]
    catalogue.cancel_batch("b1", ["doc03"], 3100.0)
    batch = catalogue.batch("b1")
    assert batch is not None and batch.doc_ids == ("doc02",) and batch.cancelled_ids == ("doc03",)
    assert batch.cancelled_at == 3100.0 and catalogue.versions(["c1"])["c1"] == version + 1
    assert [r.id for r in catalogue.members(["c1"])] == ["doc01", "doc02"]  # taken out of the collection
    assert catalogue.cancelled("c1") == ["doc03"]
    catalogue.add_members("c1", ["doc03"])  # put back: no longer counted as cancelled
    assert catalogue.cancelled("c1") == [] and catalogue.batch("nope") is None
    catalogue.delete("doc02")
    assert catalogue.batch("b1").doc_ids == ()  # type: ignore[union-attr]
    catalogue.delete_collection("c1")
    assert catalogue.batch("b1") is None

    catalogue.insert_response("resp_1", "t1", None, 5000.0, '{"a": 1}')
    catalogue.insert_response("resp_2", "t1", "resp_1", 5001.0, '{"b": 2}')
    assert catalogue.response("resp_2") == ("t1", "resp_1", '{"b": 2}') and catalogue.response("x") is None
    assert catalogue.delete_response("resp_1") and not catalogue.delete_response("resp_1")
