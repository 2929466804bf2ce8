"""``ragspec ingest`` / ``reindex`` / ``ask`` / ``list`` / ``delete`` (over HTTP and in process), run through
``app.cli.main.main`` or as the console script, and ``ragspec serve``'s start-up log."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from app.cli.main import SUBCOMMANDS, main
from app.cli.remote import follow
from retrieval.embedding import DEFAULT_BATCH_SIZE
from retrieval.store import DocumentStore
from tests.app.live import (
    DEADLINE_S,
    LANDMARKS,
    ThreadServer,
    process_env,
    service_settings,
    thread_server,
    upload_text,
    wait_for,
    wait_indexed,
)
from tests.app.slow_indexing import long_text, slow_indexing
from tests.app.test_cli import ragspec_command
from tests.conftest import BUNDLED_GGUF_DIR, free_port

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]


def test_service_subcommands_are_registered() -> None:
    assert {"ingest", "ask", "reindex", "list", "delete"} <= set(SUBCOMMANDS)


def test_ingest_reindex_and_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    for name, value in {
        "DATA_DIR": str(data),
        "TARGET_MODEL": str(BUNDLED_GGUF_DIR),
        "LOG_LEVEL": "WARNING",
        "MAX_CONTEXT": "1024",
        "THREADS": "1",
        "CALIBRATE": "false",
    }.items():
        monkeypatch.setenv(f"RAGSPEC_{name}", value)
    good = tmp_path / "landmarks.txt"
    good.write_text(LANDMARKS)
    empty = tmp_path / "empty.txt"
    empty.write_text("")

    assert main(["ingest", str(good), str(empty)]) == 1  # one file could not be stored
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1
    doc, status, path = lines[0].split("\t")[:3]
    assert status == "ready" and path == str(good)
    assert "empty.txt" in err and "empty" in err

    assert main(["reindex", "--all"]) == 0
    assert "re-indexed 1 of 1 documents" in capsys.readouterr().out
    assert main(["reindex"]) == 2  # neither ids nor --all

    with thread_server(service_settings(data)) as server:
        assert main(["ask", "Where is the Colosseum?", "--doc", doc, "--url", server.url, "--max-tokens", "8"]) == 0
        out = capsys.readouterr().out
        assert out.strip() and f"  [1] {doc}:" in out  # the answer (with its [n] citations), then its sources
        assert (
            main(["ask", "Where is the Colosseum?", "--doc", doc, "--url", server.url, "--max-tokens", "8", "--stream"])
            == 0
        )
        assert capsys.readouterr().out.strip()
        assert main(["ask", "Where?", "--doc", "missing", "--url", server.url]) == 1
        assert "404" in capsys.readouterr().err

    assert main(["ask", "Where is the Colosseum?", "--doc", doc, "--max-tokens", "8", "--json"]) == 0  # in process
    body = json.loads(capsys.readouterr().out)
    assert body["answer"] and body["sources"][0]["document_id"] == doc and "cited_answer" in body

    # a collection: asked in process and over HTTP, with a filter, and refused with a bad one
    assert main(["collections", "create", "guides"]) == 0
    col = capsys.readouterr().out.split("\t")[0]
    assert main(["collections", "add", col, doc]) == 0
    capsys.readouterr()
    assert main(["ask", "Where is the Colosseum?", "--collection", col, "--max-tokens", "8", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["sources"][0]["document_id"] == doc and body["sources"][0]["title"] == "landmarks.txt"
    assert body["stats"]["documents"] == 1
    with thread_server(service_settings(data)) as server:
        assert main(["ask", "Where is the Colosseum?", "--collection", col, "--url", server.url, "--max-tokens", "8",
                     "--filter", '{"type": "ne", "key": "missing", "value": 1}']) == 1  # no document matches
        assert "collection_not_ready" in capsys.readouterr().err
        assert main(["ask", "Where is the Colosseum?", "--collection", col, "--url", server.url, "--max-tokens",
                     "8"]) == 0
        assert f"  [1] {doc}:" in capsys.readouterr().out
    assert main(["ask", "Where?", "--collection", col, "--filter", '{"type": "near"}', "--max-tokens", "8"]) == 1
    assert "invalid_filter" in capsys.readouterr().err
    assert main(["ask", "Where?"]) == 2  # neither --doc nor --collection


# ---- local ingest / reindex: the same progress lines as ingest --url -------------------------------


LOCAL_LINE = re.compile(r"^(\S+): (indexing|ready|failed) +(\d+)%(?: (.*))?$")


def _local_progress(err: str, name: str) -> list[tuple[str, int, str | None]]:
    """The progress lines of ``name`` on stderr: (status, percent, stage)."""
    found = (LOCAL_LINE.match(line) for line in err.splitlines())
    return [(m[2], int(m[3]), m[4]) for m in found if m and m[1] == name]


def _assert_every_stage(shown: list[tuple[str, int, str | None]], passages: int) -> None:
    """Chunking, then each embedding batch with its count, building the index, ready: percents never go back."""
    percents = [p for _, p, _ in shown]
    assert percents == sorted(percents), shown
    assert shown[0] == ("indexing", 0, "chunking the text") and shown[-1] == ("ready", 100, None), shown
    counts = [int(m[1]) for *_, stage in shown if (m := re.fullmatch(rf"embedding passages: (\d+) of {passages}",
                                                                  stage or ""))]
    assert counts == [*range(0, passages, DEFAULT_BATCH_SIZE), passages], shown
    assert ("indexing", 95, "building the index") in shown


def test_local_ingest_and_reindex_show_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    for name, value in {"DATA_DIR": str(data), "TARGET_MODEL": str(BUNDLED_GGUF_DIR), "LOG_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(f"RAGSPEC_{name}", value)
    records = tmp_path / "records.txt"
    records.write_text(long_text(), encoding="utf-8")

    assert main(["ingest", str(records)]) == 0
    out, err = capsys.readouterr()
    doc, status, path, detail = out.strip().split("\t")  # the summary is one line on stdout, as before
    assert (status, path) == ("ready", str(records)) and re.fullmatch(r"\d+ chunks, \d+ tokens", detail)
    store = DocumentStore(data / "documents")
    windows = store.load_passages(doc)
    store.close()
    assert windows is not None
    passages = len(windows)
    assert passages > 3 * DEFAULT_BATCH_SIZE  # several batches
    _assert_every_stage(_local_progress(err, "records.txt"), passages)

    assert main(["reindex", "--all"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == f"{doc}\tready\trecords.txt\t{detail}" and "re-indexed 1 of 1" in out
    _assert_every_stage(_local_progress(err, doc), passages)

    terminal = Terminal()  # on a terminal: one line rewritten in place, ended once
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["reindex", doc]) == 0
    text = terminal.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1 and text.count("\r") >= passages // DEFAULT_BATCH_SIZE
    assert text.rstrip("\n").split("\r")[-1].startswith(f"{doc}: ready 100%")


# ---- commands against a server: ingest --url, list, delete ----------------------------------------


PROGRESS_LINE = re.compile(r"^records\.txt: (queued|indexing|ready) +(\d+)%")


def test_ingest_url_follows_progress_then_list_and_delete(
    server: ThreadServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "records.txt"
    good.write_text(long_text(), encoding="utf-8")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with slow_indexing(server, pause_s=0.4) as embedder:
        assert main(["ingest", "--url", server.url, str(good), str(empty), str(tmp_path / "missing.txt")]) == 1
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    doc, status, path, detail = lines[0].split("\t")
    assert (status, path) == ("ready", str(good)) and re.fullmatch(r"\d+ chunks, \d+ tokens", detail)
    assert "empty.txt: HTTP 422" in err and "missing.txt" in err
    shown = [m.groups() for line in err.splitlines() if (m := PROGRESS_LINE.match(line))]
    percents = [int(p) for _, p in shown]
    assert percents == sorted(percents) and shown[-1] == ("ready", "100")
    assert embedder.batches >= 4 and len({p for p in percents if 0 < p < 100}) >= embedder.batches, err
    assert any("embedding passages:" in line for line in err.splitlines())

    assert main(["list", "--url", server.url]) == 0
    listed = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert listed[doc][1] == "ready" and listed[doc][3] == detail
    assert main(["list", "--url", server.url, "--json"]) == 0
    assert doc in {d["id"] for d in json.loads(capsys.readouterr().out)["documents"]}

    assert main(["delete", doc, "--url", server.url]) == 0
    assert capsys.readouterr().out.strip() == f"{doc}\tdeleted"
    assert main(["delete", doc, "--url", server.url]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["list", "--url", server.url]) == 0
    assert doc not in capsys.readouterr().out


def test_ingest_url_no_wait_and_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With keys on: no key -> 401 named with the hint, one line per file; with a key -> the id at once."""
    good = tmp_path / "landmarks.txt"
    good.write_text(LANDMARKS)
    with thread_server(service_settings(tmp_path / "data", api_keys=["k1"])) as server:
        assert main(["ingest", "--url", server.url, str(good), str(good)]) == 1
        err = capsys.readouterr().err
        assert err.count("HTTP 401") == 1 and "--api-key" in err
        assert main(["ingest", "--url", server.url, "--api-key", "k1", "--no-wait", str(good)]) == 0
        doc, status, path = capsys.readouterr().out.strip().split("\t")
        assert (status, path) == ("queued", str(good))
        with server.client("k1") as client:
            assert wait_indexed(client, doc)["status"] == "ready"
        assert main(["list", "--url", server.url]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert main(["list", "--url", server.url, "--api-key", "k1"]) == 0
        assert capsys.readouterr().out.startswith(f"{doc}\tready\t")


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ragspec_command(), *args], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "RAGSPEC_LOG_LEVEL": "INFO", **env},
    )


def test_a_server_that_is_down_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    doc = tmp_path / "a.txt"
    doc.write_text(LANDMARKS)
    commands = (["list"], ["delete", "abc"], ["ingest", "--url", url, str(doc)],
                ["ask", "q", "--doc", "x", "--url", url])
    for args in commands:
        done = _cli(*args, RAGSPEC_PORT=str(port))  # list and delete default to http://RAGSPEC_HOST:RAGSPEC_PORT
        assert done.returncode == 1, (args, done.stderr)
        assert done.stderr.splitlines() == [
            f"ragspec: cannot reach the server at {url} (connection refused: is `ragspec serve` running there?)"
        ], args
        assert done.stdout == ""


def test_third_party_info_logs_are_quiet_unless_verbose(server: ThreadServer) -> None:
    quiet = _cli("list", "--url", server.url)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr  # httpx logs each request at INFO
    verbose = _cli("--verbose", "list", "--url", server.url)
    assert verbose.returncode == 0 and "httpx: HTTP Request: GET" in verbose.stderr


def test_help_names_the_default_server() -> None:
    for command in ("list", "delete", "ingest"):
        assert "127.0.0.1:8000" in _cli(command, "--help").stdout


# ---- ragspec serve ---------------------------------------------------------------------------------


def _serve(tmp_path: Path, port: int, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{name}.log"
    env = {**os.environ, **process_env(service_settings(tmp_path / name)), "RAGSPEC_LOG_LEVEL": "INFO"}
    with log.open("wb") as sink:
        proc = subprocess.Popen([*ragspec_command(), "serve", "--port", str(port)], env=env, stdout=sink,
                                stderr=subprocess.STDOUT)
    return proc, log


def test_serve_says_serving_only_once_bound(tmp_path: Path) -> None:
    port = free_port()
    proc, log = _serve(tmp_path, port, "bound")
    serving = f"serving on http://127.0.0.1:{port}"
    try:
        wait_for(lambda: serving in log.read_text() or proc.poll() is not None, "the serving line")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200  # bound by then
        text = log.read_text()
        assert text.count(serving) == 1
        assert text.index("services ready") < text.index(serving)  # models loaded first
        assert text.index("Application startup complete") < text.index(serving)
    finally:
        proc.terminate()
        proc.wait(60)


def test_serve_on_a_taken_port_never_says_serving(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, log = _serve(tmp_path, port, "taken")
        try:
            assert proc.wait(DEADLINE_S) != 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    text = log.read_text()
    assert "address already in use" in text.lower() and "serving on" not in text


def test_serve_with_an_unreachable_catalogue_database_stops_with_one_line(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, **process_env(service_settings(tmp_path / "db")),
           "RAGSPEC_DATABASE_URL": f"postgresql://ragspec:s3cret@127.0.0.1:{free_port()}/catalogue"}
    run = subprocess.run([*ragspec_command(), "serve", "--port", str(port)], env=env, capture_output=True, text=True,
                         timeout=DEADLINE_S)  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "RAGSPEC_DATABASE_URL" in lines[0] and "unreachable" in lines[0], run.stderr
    assert "s3cret" not in run.stderr and "Traceback" not in run.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_line_rewritten(server: ThreadServer, client: httpx.Client) -> None:
    with slow_indexing(server, pause_s=0.2):
        doc_id = upload_text(client, long_text(), title="tty")
        out = Terminal()
        assert follow(client, doc_id, "tty.txt", out, poll_s=0.05)["status"] == "ready"
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1 and text.count("\r") >= 4, text
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[-1].startswith("tty.txt: ready 100%")
    assert all(len(later) >= len(earlier.rstrip()) for earlier, later in itertools.pairwise(frames))  # covered


def test_bad_settings_are_one_line() -> None:
    for args, env, start in (
        (["list"], {"RAGSPEC_PORT": "abc"}, "ragspec: bad setting: RAGSPEC_PORT: "),
        (["--log-level", "LOUD", "list"], {}, "ragspec: bad setting: Unknown level: 'LOUD'"),
    ):
        done = _cli(*args, **env)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and done.stderr.startswith(start), done
