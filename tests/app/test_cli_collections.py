"""``ragspec collections`` (create, list, show, rename, delete, add, remove, documents) and ``ragspec ingest
--collection / --attribute``, in process on the data dir's store and against a server with ``--url``: the same lines
either way, errors as one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.collections import attribute
from app.cli.main import SUBCOMMANDS, main
from app.serving.auth import tenant_of_key
from retrieval.store import DEFAULT_TENANT, DocumentStore
from tests.app.live import ThreadServer, upload_text, wait_indexed
from tests.conftest import BUNDLED_GGUF_DIR


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    data = tmp_path / "data"
    for name, value in {"DATA_DIR": str(data), "TARGET_MODEL": str(BUNDLED_GGUF_DIR), "LOG_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(f"RAGSPEC_{name}", value)
    return data


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["collections", *argv]) if argv[0] != "ingest" else main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_attribute_values_are_json_when_they_parse() -> None:
    assert "collections" in SUBCOMMANDS
    assert attribute("year=2024") == ("year", 2024)
    assert attribute("draft=true") == ("draft", True)
    assert attribute("score=0.5") == ("score", 0.5)
    assert attribute('code="2024"') == ("code", "2024")
    assert attribute("team=search") == ("team", "search")
    assert attribute("note=a=b") == ("note", "a=b")
    with pytest.raises(SystemExit):
        main(["ingest", "x.txt", "--attribute", "no-equals-sign"])


def test_collections_in_process(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No server and no model: the data dir's store, as the default tenant (or --api-key's)."""
    store = DocumentStore(data_dir / "documents")
    first = store.create(DEFAULT_TENANT, "first", "a.txt", "text/plain", b"The first text.").id
    second = store.create(DEFAULT_TENANT, "second", "b.txt", "text/plain", b"The second text.").id
    foreign = store.create(tenant_of_key("other-key"), "theirs", "c.txt", "text/plain", b"Their text.").id
    store.close()

    code, out, _ = run(capsys, "create", "Reports", "--description", "yearly", "--metadata", "team=search", "k=a=b")
    assert code == 0
    cid, name = out.strip().split("\t")
    assert name == "Reports" and cid.startswith("col")
    code, out, _ = run(capsys, "add", cid, first, second)
    assert code == 0 and out.splitlines() == [f"{first}\tin {cid}", f"{second}\tin {cid}",
                                              f"{cid}\t2 documents (0 ready, 2 pending)"]
    code, out, _ = run(capsys, "show", cid)
    shown = json.loads(out)
    assert (shown["name"], shown["description"], shown["metadata"]) == ("Reports", "yearly",
                                                                      {"team": "search", "k": "a=b"})
    assert shown["document_counts"] == {"queued": 2, "indexing": 0, "ready": 0, "failed": 0, "total": 2}
    assert run(capsys, "rename", cid, "Annual")[1] == f"{cid}\tAnnual\n"
    assert run(capsys, "list")[1] == f"{cid}\tAnnual\t2 documents (0 ready, 2 pending)\n"
    assert [c["id"] for c in json.loads(run(capsys, "list", "--json")[1])["data"]] == [cid]
    code, out, _ = run(capsys, "documents", cid)
    assert [line.split("\t")[:3] for line in out.splitlines()] == [[first, "queued", "first"],
                                                                   [second, "queued", "second"]]
    assert run(capsys, "remove", cid, first)[1] == f"{first}\tremoved from {cid}\n"
    assert [d["id"] for d in json.loads(run(capsys, "documents", cid, "--json")[1])["data"]] == [second]

    # errors: one line on stderr, the code and message the server would give, exit 1
    for argv, expected in (
        (("show", "col-unknown"), "collection_not_found: collection 'col-unknown' not found"),
        (("add", cid, foreign), f"document_not_found: document '{foreign}' not found"),  # another tenant's
        (("remove", cid, first), f"document_not_found: document '{first}' not found"),  # not in it any more
        (("create", "x" * 257), "invalid_request: name: String should have at most 256 characters"),
        (("show", cid, "--api-key", "other-key"), f"collection_not_found: collection '{cid}' not found"),
    ):
        code, out, err = run(capsys, *argv)
        assert (code, out, err.strip()) == (1, "", expected), argv
    assert run(capsys, "list", "--api-key", "other-key")[1] == ""  # its tenant has none

    assert run(capsys, "delete", cid, "--delete-documents")[1] == f"{cid}\tdeleted with its documents\n"
    store = DocumentStore(data_dir / "documents")
    assert [r.id for r in store.list()] == [first, foreign]  # the second went with the collection
    store.close()
    assert run(capsys, "delete", cid)[0] == 1


@pytest.mark.real_model
def test_ingest_into_a_collection_in_process(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cid = run(capsys, "create", "Notes")[1].split("\t")[0]
    text = tmp_path / "notes.txt"
    text.write_text("The lighthouse was built in 1872 on the island.")
    refused = run(capsys, "ingest", str(text), "--collection", "col-unknown")
    assert refused[0] == 1 and "collection 'col-unknown' not found" in refused[2]
    bad = run(capsys, "ingest", str(text), "--attribute", f"{'k' * 65}=1")
    assert bad[0] == 2 and bad[2].startswith("--attribute: attributes: a key must be 1-64 characters")
    assert json.loads(run(capsys, "show", cid)[1])["document_counts"]["total"] == 0  # nothing stored

    code, out, _ = run(capsys, "ingest", str(text), "--collection", cid, "--attribute", "year=2024",
                       "--attribute", "team=search", "--attribute", "draft=false")
    assert code == 0, out
    doc, status = out.split("\t")[:2]
    assert status == "ready"
    assert run(capsys, "documents", cid)[1].split("\t")[:2] == [doc, "ready"]
    (listed,) = json.loads(run(capsys, "documents", cid, "--json")[1])["data"]
    assert listed["attributes"] == {"year": 2024, "team": "search", "draft": False}
    assert listed["collection_ids"] == [cid]
    assert json.loads(run(capsys, "show", cid)[1])["document_counts"]["ready"] == 1


@pytest.mark.real_model
def test_collections_against_a_server(server: ThreadServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--url", server.url)
    code, out, _ = run(capsys, "create", "Remote", "--metadata", "team=search", *url)
    assert code == 0
    cid = out.split("\t")[0]
    text = tmp_path / "notes.txt"
    text.write_text("Kestrels hover over fields while hunting.")
    code, out, err = run(capsys, "ingest", "--url", server.url, str(text), "--collection", cid, "--attribute",
                         "year=2024", "--attribute", "kind=bird")
    assert code == 0, err
    doc, status = out.split("\t")[:2]
    assert status == "ready"
    with server.client() as client:
        record = client.get(f"/v1/documents/{doc}").json()
        assert (record["collection_ids"], record["attributes"]) == ([cid], {"year": 2024, "kind": "bird"})
        other = upload_text(client, "Herons stand still in shallow water.", title="herons")
        assert wait_indexed(client, other)["status"] == "ready"

    code, out, _ = run(capsys, "add", cid, other, *url)
    assert code == 0 and out.splitlines()[-1] == f"{cid}\t2 documents (2 ready)"
    shown = json.loads(run(capsys, "show", cid, *url)[1])
    assert shown["document_counts"] == {"queued": 0, "indexing": 0, "ready": 2, "failed": 0, "total": 2}
    assert shown["metadata"] == {"team": "search"} and shown["chunks"] >= 2
    assert run(capsys, "rename", cid, "Birds", *url)[1] == f"{cid}\tBirds\n"
    assert f"{cid}\tBirds\t2 documents (2 ready)" in run(capsys, "list", *url)[1].splitlines()
    lines = run(capsys, "documents", cid, *url)[1].splitlines()
    assert [line.split("\t")[:3] for line in lines] == [[doc, "ready", "notes.txt"], [other, "ready", "herons"]]
    assert json.loads(lines[0].split("\t")[4]) == {"year": 2024, "kind": "bird"}
    assert run(capsys, "remove", cid, other, *url)[1] == f"{other}\tremoved from {cid}\n"

    code, out, err = run(capsys, "show", "col-unknown", *url)
    assert (code, out) == (1, "") and err.startswith("HTTP 404 collection_not_found:")
    code, out, err = run(capsys, "ingest", "--url", server.url, str(text), str(text), "--collection", "col-unknown")
    assert code == 1 and err.count("HTTP 404 collection_not_found") == 1  # every other file would be refused too

    assert run(capsys, "delete", cid, "--delete-documents", *url)[1] == f"{cid}\tdeleted with its documents\n"
    with server.client() as client:
        assert client.get(f"/v1/documents/{doc}").status_code == 404
        assert client.get(f"/v1/documents/{other}").status_code == 200  # removed before: kept
    assert run(capsys, "delete", cid, *url)[0] == 1
