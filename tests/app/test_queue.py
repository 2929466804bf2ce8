"""One generation at a time (``max_batch=1``): with ``queue_size=0`` a second question while one runs is a 429 with
Retry-After; a streaming client that disconnects cancels its generation and frees the slot."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from tests.app.live import LANDMARKS, ThreadServer, metric, upload_text, wait_for, wait_indexed

pytestmark = pytest.mark.real_model

# Greedy SmolLM2 answers this with a long list (over a hundred tokens), so the first generation is
# still running when the second request arrives a few milliseconds after its first token.
LONG_QUESTION = "Write the numbers from 1 to 200, one per line."


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"queue_size": 0, "max_batch": 1, "max_new_tokens": 768}


def test_full_queue_is_429_and_a_disconnect_frees_the_slot(server: ThreadServer) -> None:
    with server.client() as client:
        doc = upload_text(client, LANDMARKS)
        assert wait_indexed(client, doc)["status"] == "ready"
        short = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 4}
        long = {
            "question": LONG_QUESTION,
            "document_ids": [doc],
            "max_tokens": 256,
            "frequency_penalty": 0,  # the raw model: it counts on and on (a penalty lets it stop early)
            "mode": "autoregressive",
            "stream": True,
        }

        with server.client() as streamer, connect_sse(streamer, "POST", "/v1/ask", json=long) as source:
            events = source.iter_sse()
            assert next(events).event == "sources"
            assert next(e for e in events if e.event != "progress").event == "token"  # it holds the only slot
            refused = client.post("/v1/ask", json=short)
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "overloaded"
            assert metric(client, "ragspec_generation_running") == 1
            assert metric(client, "ragspec_overloaded_total") == 1
        # leaving the block closed the stream mid-answer: the server cancels that generation

        def slot_free() -> bool:
            cancelled = metric(client, "ragspec_generations_total", mode="autoregressive", finish_reason="cancelled")
            return cancelled == 1 and metric(client, "ragspec_generation_running") == 0

        wait_for(slot_free, "the disconnected generation to be cancelled")
        follow = client.post("/v1/ask", json=short)
        assert follow.status_code == 200, follow.text
        assert follow.json()["answer"]
        # the cancelled answer never reached the finished ones
        assert metric(client, "ragspec_generations_total", mode="autoregressive", finish_reason="length") == 0
        assert metric(client, "ragspec_generations_total", mode="autoregressive", finish_reason="stop") == 0


def test_a_plain_request_that_goes_away_is_cancelled_too(server: ThreadServer) -> None:
    with server.client() as client:
        doc = upload_text(client, LANDMARKS)
        assert wait_indexed(client, doc)["status"] == "ready"
        labels = {"mode": "autoregressive", "finish_reason": "cancelled"}
        cancelled = metric(client, "ragspec_generations_total", **labels)
        never_ends = {str(t): -100 for t in server.app.state.services.target.eos_token_ids}  # banned: all 768
        long = {"question": LONG_QUESTION, "document_ids": [doc], "max_tokens": 768, "mode": "autoregressive",
                "frequency_penalty": 0, "logit_bias": never_ends}  # the raw model counts on (a penalty stops it)
        # the answer takes seconds even on the quantized runtime (768 tokens, one thread; it stopped by itself
        # after ~120 tokens, 0.43 s on an AVX-512 EPYC)
        with server.client(timeout=0.75) as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/ask", json=long)  # gives up and closes the connection

        def freed() -> bool:
            gone = metric(client, "ragspec_generations_total", **labels) == cancelled + 1
            return gone and metric(client, "ragspec_generation_running") == 0

        wait_for(freed, "the abandoned generation to be cancelled")
        short = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 4}
        assert client.post("/v1/ask", json=short).status_code == 200
