"""Many people at once over HTTP on the bundled model: generations run together (their forwards batched) and each
answer is the one it gets alone, in every decoding mode; a request whose KV cache could never fit the working
pool is refused at once (413); the batch's Prometheus series are there."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.app.live import LANDMARKS, LIGHTHOUSE, ThreadServer, metric, upload_text, wait_indexed

pytestmark = pytest.mark.real_model

OVER_WINDOW = "\n\n".join(f"Section {i}. {LANDMARKS}" for i in range(12))  # longer than the test servers' 1024 window


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_batch": 4, "queue_size": 8}


def path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/ask"


def answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    body = response.json()
    return str(body["choices"][0]["message"]["content"] if "choices" in body else body["answer"])


def test_concurrent_questions_get_their_solo_answers(server: ThreadServer) -> None:
    with server.client() as client:
        landmarks = upload_text(client, LANDMARKS)
        lighthouse = upload_text(client, LIGHTHOUSE)
        long_doc = upload_text(client, OVER_WINDOW)
        assert all(wait_indexed(client, d)["status"] == "ready" for d in (landmarks, lighthouse, long_doc))
        bodies = [
            {"question": "When was the Eiffel Tower completed?", "document_ids": [landmarks], "mode": "autoregressive"},
            {"question": "Who began the Colosseum?", "document_ids": [landmarks], "mode": "auto"},
            {"question": "How long is the Great Wall?", "document_ids": [landmarks], "mode": "racer"},
            {"question": "What does the lighthouse keeper do?", "document_ids": [lighthouse], "mode": "rapid_kv"},
            {"messages": [{"role": "user", "content": "Say hello."}]},  # chat, no document prefix at all
            {"question": "Where is Big Ben?", "document_ids": [landmarks], "mode": "autoregressive",
             "temperature": 0.8, "seed": 11},
            {"question": "How tall is the Eiffel Tower?", "document_ids": [long_doc], "mode": "auto"},  # over-window
        ]
        for body in bodies:
            body["max_tokens"] = 24
        solo = [answer(client.post(path(body), json=body)) for body in bodies]
        forwards, sequences = metric(client, "ragspec_batch_forwards_total"), metric(
            client, "ragspec_batch_sequences_total")

        together: list[Any] = [None] * len(bodies)
        start = threading.Barrier(len(bodies))

        def ask(i: int) -> None:
            with server.client() as own:
                start.wait()
                together[i] = answer(own.post(path(bodies[i]), json=bodies[i]))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert together == solo
        more_forwards = metric(client, "ragspec_batch_forwards_total") - forwards
        more_sequences = metric(client, "ragspec_batch_sequences_total") - sequences
        assert more_sequences > more_forwards, "no forward held two sequences"
        assert metric(client, "ragspec_queue_wait_seconds_count") >= 2 * len(bodies)
        assert metric(client, "ragspec_generations_running") == 0


def test_a_request_that_could_never_fit_the_pool_is_refused(server: ThreadServer) -> None:
    with server.client() as client:
        doc = upload_text(client, OVER_WINDOW)
        assert wait_indexed(client, doc)["status"] == "ready"
        services = server.services
        pool = services.scheduler.pool_bytes
        services.scheduler.pool_bytes = services.engine.kv_bytes(200)  # less than that prompt's cache
        try:
            response = client.post("/v1/ask", json={"question": "What is Big Ben?", "document_ids": [doc],
                                                    "max_tokens": 64})
            small = client.post("/v1/chat/completions",  # a small one fits: the service goes on
                                json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
        finally:
            services.scheduler.pool_bytes = pool
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "payload_too_large" and "RAGSPEC_KV_POOL_BYTES" in error["message"]
        assert small.status_code == 200, small.text
