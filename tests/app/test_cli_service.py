"""``ragspec ingest`` / ``reindex`` / ``ask`` (over HTTP and in process), run through ``app.cli.main``."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import SUBCOMMANDS, main
from tests.app.live import LANDMARKS, service_settings, thread_server
from tests.conftest import BUNDLED_GGUF_DIR

pytestmark = pytest.mark.real_model


def test_service_subcommands_are_registered() -> None:
    assert {"ingest", "ask", "reindex"} <= set(SUBCOMMANDS)


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
        assert out.strip() and f"[{doc}:" in out  # the answer, then its sources
        assert (
            main(["ask", "Where is the Colosseum?", "--doc", doc, "--url", server.url, "--max-tokens", "8", "--stream"])
            == 0
        )
        assert capsys.readouterr().out.strip()
        assert main(["ask", "Where?", "--doc", "missing", "--url", server.url]) == 1
        assert "404" in capsys.readouterr().err

    assert main(["ask", "Where is the Colosseum?", "--doc", doc, "--max-tokens", "8", "--json"]) == 0  # in process
    out = capsys.readouterr().out
    assert '"answer"' in out and doc in out
