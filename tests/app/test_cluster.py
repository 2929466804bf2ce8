"""Cluster mode for real: ``ragspec serve --cluster`` in a subprocess (one command: a local Ray on loopback, Serve's
proxy, an ingress and two engine replicas with the bundled model), its catalogue in a real PostgreSQL, sessions in a
real Redis. Documents uploaded through the ingress are ingested once; a document's questions land on one replica
(whose KV prefix makes the second one's first token far faster), the other replica gives the same bytes; a session's
follow-up reaches the owner; a replica killed, its next request is served by the other; an ingestion worker killed
mid-ingest, another takes its job over once the lease runs out. Bad configuration is one clear line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.live import DEADLINE_S, process_env, service_settings, upload_text, wait_for, wait_indexed
from tests.conftest import REPO, free_port, running_postgres, running_redis

pytestmark = [pytest.mark.cluster, pytest.mark.real_model, pytest.mark.redis, pytest.mark.heavy]

REPLICA = "x-ragspec-replica"
LEASE_S = 4.0
KEY, OTHER_KEY = "cluster-key-a", "cluster-key-b"  # two tenants


@dataclass
class Cluster:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    database: str
    ray_dir: Path

    def client(self, key: str | None = KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, timeout=DEADLINE_S, headers=headers)

    def replica_logs(self) -> str:
        """What the replicas' processes wrote, read from their own log files (the command's copy lags)."""
        files = sorted((self.ray_dir / "session_latest" / "logs").glob("worker-*"))
        return "".join(f.read_text(errors="replace") for f in files)


def _start(env: dict[str, str], log: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli.main", "serve", "--cluster", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO, env={**os.environ, **env}, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):  # Ray's own processes, if the command could not stop them
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("cluster")
    with running_postgres() as pg, running_redis(tmp_path_factory.mktemp("cluster-redis")) as redis:
        database = pg.create_database("cluster")
        settings = service_settings(work / "data", database_url=database, redis_url=redis.url,
                                    ingest_lease_s=LEASE_S, cluster_replicas=2, max_context=2048,
                                    api_keys=[KEY, OTHER_KEY], max_upload_mb=1.0,
                                    kv_pool_bytes=512 * 1024 * 1024)
        ray_dir = Path(tempfile.mkdtemp(prefix="rs-ray-"))  # short: Ray's socket paths live under it
        env = process_env(settings) | {"RAY_USAGE_STATS_ENABLED": "0", "RAGSPEC_RAY_TEMP_DIR": str(ray_dir)}
        port = free_port()
        log = work / "cluster.log"
        proc = _start(env, log, port)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the cluster exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                return httpx.get(url + "/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_for(up, "the cluster to serve", every_s=1.0)
            wait_for(lambda: "serving on" in log.read_text(), "every replica to be up")
            assert re.search(r"Ray cluster at 127\.0\.0\.1:\d+", log.read_text())  # on loopback
            yield Cluster(url=url, proc=proc, log=log, database=database, ray_dir=ray_dir)
        finally:
            _stop(proc)
            shutil.rmtree(ray_dir, ignore_errors=True)


def _text(words: int, seed: int) -> str:
    topics = ["granite quarry", "tidal mill", "beekeeping guild", "glass furnace", "salt marsh"]
    lines = []
    for i in range(words // 12):
        topic = topics[(i * 7 + seed) % len(topics)]
        lines.append(f"Record {seed}-{i}: the {topic} reported {i * 13 % 97} crates on day {i % 28 + 1}.")
    return " ".join(lines)


def _ask_stream(client: httpx.Client, headers: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    """Stream an answer: its text, first-token time, session, stats and the replica that served it."""
    body.setdefault("max_tokens", 16)
    t0 = time.perf_counter()
    first = None
    text = []
    session = None
    stats: dict[str, Any] = {}
    with client.stream("POST", "/v1/ask", json={**body, "stream": True}, headers=headers or {}) as response:
        assert response.status_code == 200, response.read()
        event = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "token":
                first = first or time.perf_counter() - t0
                text.append(json.loads(line[5:])["text"])
            elif line.startswith("data:") and event == "done":
                done = json.loads(line[5:])
                session = done.get("session_id")
                stats["prompt_tokens"] = done.get("usage", {}).get("prompt_tokens")
            elif line.startswith("data:") and event == "stats":
                stats.update(json.loads(line[5:]))
        replica = response.headers[REPLICA]
    return {"text": "".join(text), "ttft": first, "session": session, "replica": replica, "stats": stats}


@pytest.fixture(scope="module")
def documents(cluster: Cluster) -> list[str]:
    with cluster.client() as client:
        ids = [upload_text(client, _text(1100, seed), title=f"ledger {seed}") for seed in (1, 2)]
        for doc_id in ids:
            assert wait_indexed(client, doc_id)["status"] == "ready"
    return ids


def test_documents_uploaded_through_the_ingress_are_ingested_once(cluster: Cluster, documents: list[str]) -> None:
    log = cluster.replica_logs()
    for doc_id in documents:
        assert log.count(f"indexed document {doc_id}") == 1, log[-3000:]
    import psycopg

    with psycopg.connect(cluster.database) as conn:
        assert conn.execute("SELECT count(*) FROM ingest_jobs").fetchone() == (0,)
        statuses = conn.execute("SELECT status FROM documents ORDER BY id").fetchall()
    assert statuses == [("ready",), ("ready",)]


QUESTION = "How many crates did the tidal mill report?"


def test_a_document_asked_twice_lands_on_one_replica_and_the_other_gives_the_same_bytes(
        cluster: Cluster, documents: list[str]) -> None:
    with cluster.client() as client:
        first = _ask_stream(client, question=QUESTION, document_ids=[documents[0]])
        second = _ask_stream(client, question=QUESTION, document_ids=[documents[0]])
        assert second["replica"] == first["replica"]
        assert second["text"] == first["text"] and first["text"]
        assert first["ttft"] >= 10 * second["ttft"], (first["ttft"], second["ttft"])
        other = _other_replica(cluster, first["replica"])
        forced = _ask_stream(client, headers={REPLICA: other}, question=QUESTION, document_ids=[documents[0]])
        assert forced["replica"] == other
        assert forced["text"].encode() == first["text"].encode()


def _other_replica(cluster: Cluster, name: str) -> str:
    """The other engine replica's name: an unkeyed request (a document list) goes to the least loaded."""
    with cluster.client() as client:
        return str(wait_for(lambda: next((r for r in (client.get("/v1/documents").headers[REPLICA]
                                                       for _ in range(8)) if r != name), None),
                            "a request on the other replica", deadline_s=60))


def test_a_follow_up_in_a_session_reaches_the_document_s_owner(cluster: Cluster, documents: list[str]) -> None:
    with cluster.client() as client:
        opening = _ask_stream(client, question="What did the salt marsh report?", document_ids=[documents[1]])
        follow = _ask_stream(client, question="And on which day?", session_id=opening["session"])
        assert follow["replica"] == opening["replica"]
        # its documents' KV was there: the follow-up's prompt is read from the cache but for its new turn
        reused, prompt = follow["stats"]["prefix_reused_tokens"], follow["stats"]["prompt_tokens"]
        assert reused >= 1000 and prompt - reused < 200, follow["stats"]


def test_auth_tenancy_and_the_openai_api_behave_as_in_one_process(cluster: Cluster, documents: list[str]) -> None:
    import openai

    with cluster.client(key=None) as anonymous:
        refused = anonymous.post("/v1/ask", json={"question": QUESTION, "document_ids": [documents[0]]})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    with cluster.client(key=OTHER_KEY) as other:  # another tenant sees none of these documents
        assert other.get(f"/v1/documents/{documents[0]}").status_code == 404
        assert other.get("/v1/documents").json()["documents"] == []
        hidden = other.post("/v1/ask", json={"question": QUESTION, "document_ids": [documents[0]]})
        assert hidden.status_code == 404
    with cluster.client() as client:  # refused at the entry, before it is held and sent on
        huge = client.post("/v1/documents", json={"text": "x" * (3 << 20)})
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY)
    stream = client.chat.completions.create(
        model="ragspec", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, stream=True,
        extra_body={"document_ids": [documents[0]]})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    whole = client.chat.completions.create(
        model="ragspec", messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
        extra_body={"document_ids": [documents[0]]})
    assert streamed and streamed == whole.choices[0].message.content


def test_every_replica_answers_a_collection_and_follows_its_changes(cluster: Cluster, documents: list[str]) -> None:
    with cluster.client() as client:
        made = client.post("/v1/collections", json={"name": "ledgers"})
        assert made.status_code == 201, made.text
        col = made.json()["id"]
        added = client.post(f"/v1/collections/{col}/documents", json={"document_ids": documents})
        assert added.status_code == 200 and added.json()["document_counts"]["ready"] == 2
        body = {"question": QUESTION, "collection_ids": [col], "max_tokens": 16}
        first = _ask_stream(client, **body)
        again = _ask_stream(client, **body)
        assert again["replica"] == first["replica"] and again["text"] == first["text"] and first["text"]
        other = _other_replica(cluster, first["replica"])  # its index is its own, built from the catalogue
        forced = _ask_stream(client, headers={REPLICA: other}, **body)
        assert forced["replica"] == other and forced["text"].encode() == first["text"].encode()
        for replica in (first["replica"], other):
            answer = client.post("/v1/ask", json=body, headers={REPLICA: replica}).json()
            assert answer["stats"]["context"] == "chunks" and answer["stats"]["documents"] == 2
        assert client.delete(f"/v1/collections/{col}/documents/{documents[0]}").status_code == 204
        for replica in (first["replica"], other):  # gone from the next answer, wherever it is served
            answer = client.post("/v1/ask", json=body, headers={REPLICA: replica}).json()
            assert {s["document_id"] for s in answer["sources"]} <= {documents[1]}
            assert answer["stats"]["documents"] == 1
    with cluster.client(key=OTHER_KEY) as stranger:
        assert stranger.post("/v1/ask", json=body).status_code == 404


def _kill_replica(cluster: Cluster, name: str) -> None:
    """Kill an engine replica's process with SIGKILL, as a crash would (Serve then starts a new one). Its pid is
    the end of the name of the Ray worker log that says the replica is ready."""
    logs = cluster.ray_dir / "session_latest" / "logs"
    found = [f for f in logs.glob("worker-*.err") if f"engine replica {name} ready" in f.read_text(errors="replace")]
    assert len(found) == 1, [f.name for f in found]
    os.kill(int(found[0].stem.rsplit("-", 1)[1]), signal.SIGKILL)


LONG_QUESTION = "List every record of the granite quarry, one per line, with its crates and its day."


def test_a_replica_killed_mid_answer_its_next_request_is_served_by_the_other(cluster: Cluster,
                                                                             documents: list[str]) -> None:
    with cluster.client() as client:
        before = _ask_stream(client, question=QUESTION, document_ids=[documents[0]])
        body = {"question": LONG_QUESTION, "document_ids": [documents[0]], "max_tokens": 400, "stream": True}
        events: list[str] = []
        with client.stream("POST", "/v1/ask", json=body) as response:
            victim = response.headers[REPLICA]
            assert victim == before["replica"]  # the document's owner
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("event: token"):
                    break
            _kill_replica(cluster, victim)
            with contextlib.suppress(httpx.HTTPError):  # the connection is cut, or the stream ends early
                events = [line for line in lines if line.startswith("event:")]
        assert "event: done" not in events  # that answer did not finish as if nothing happened
        after = _ask_stream(client, question=QUESTION, document_ids=[documents[0]])
        assert after["replica"] != victim
        assert after["text"] == before["text"]


def test_an_ingestion_worker_killed_mid_ingest_the_document_still_gets_ready(cluster: Cluster) -> None:
    import psycopg

    with cluster.client() as client:
        doc_id = upload_text(client, _text(12000, 9), title="long ledger")

        def holder() -> int | None:
            with psycopg.connect(cluster.database) as conn:
                row = conn.execute("SELECT j.owner FROM ingest_jobs j JOIN documents d ON d.id = j.doc_id "
                                   "WHERE j.doc_id = %s AND d.status = 'indexing' AND d.progress > 0.05",
                                   (doc_id,)).fetchone()
            return int(row[0].split(":")[1]) if row and row[0] else None

        pid = wait_for(holder, "the ingest to be under way", deadline_s=120)
        os.kill(pid, signal.SIGKILL)
        record = wait_indexed(client, doc_id)
    assert record["status"] == "ready", record
    log = cluster.replica_logs()
    assert "taking over the ingestion of " + doc_id in log


@pytest.mark.parametrize(("env", "message"), [
    ({"RAGSPEC_DATABASE_URL": "", "RAGSPEC_REDIS_URL": "redis://127.0.0.1:1"}, "RAGSPEC_DATABASE_URL is not set"),
    ({"RAGSPEC_DATABASE_URL": "postgresql://u:pw@127.0.0.1:1/x", "RAGSPEC_REDIS_URL": ""}, "RAGSPEC_REDIS_URL"),
    ({"RAGSPEC_DATABASE_URL": "postgresql://u:pw@127.0.0.1:1/x", "RAGSPEC_REDIS_URL": "redis://127.0.0.1:1"},
     "unreachable"),
    ({"RAGSPEC_CLUSTER_REPLICAS": "0"}, "RAGSPEC_CLUSTER_REPLICAS"),
])
def test_bad_cluster_configuration_is_one_clear_line(tmp_path: Path, env: dict[str, str], message: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAGSPEC_")}
    done = subprocess.run([sys.executable, "-m", "app.cli.main", "serve", "--cluster"], cwd=REPO,
                          env={**clean, "RAGSPEC_DATA_DIR": str(tmp_path), **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "pw@" not in done.stderr
