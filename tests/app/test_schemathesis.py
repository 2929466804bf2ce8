"""Property-based requests from the service's own OpenAPI schema (Schemathesis CLI, bounded run): bad
input of every shape gets a 4xx, never a 5xx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.app.live import LANDMARKS, ThreadServer, upload_text, wait_indexed

pytestmark = pytest.mark.real_model

ST = Path(sys.executable).parent / "st"


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_new_tokens": 2, "default_max_tokens": 2, "api_keys": "st-key"}


def test_no_server_errors_over_the_schema(server: ThreadServer, tmp_path: Path) -> None:
    with server.client("st-key") as client:  # one real document, so some generated ids can exist
        assert wait_indexed(client, upload_text(client, LANDMARKS))["status"] == "ready"
    done = subprocess.run(
        [
            str(ST),
            "run",
            f"{server.url}/openapi.json",
            "--header",
            "Authorization: Bearer st-key",
            "--checks",
            "not_a_server_error",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            "10",
            "--seed",
            "7",
            "--workers",
            "1",
            "--suppress-health-check",
            "all",
            "--report-dir",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    with server.client("st-key") as client:
        requests = [
            line
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("ragspec_http_requests_total")
        ]
    assert done.returncode == 0, done.stdout[-6000:]
    assert "generated" in done.stdout
    assert [line for line in requests if 'status="5' in line] == []
    # the key was sent: generated bodies reached validation (422) and the handlers (200 / 404)
    for route, status in (("/v1/ask", "422"), ("/v1/documents", "202"), ("/v1/documents/{document_id}", "404")):
        assert any(f'route="{route}"' in line and f'status="{status}"' in line for line in requests), route
