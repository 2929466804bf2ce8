"""A slow first token over real HTTP: streams send their first bytes at once, keep-alive comments
(``: ping``) and queued progress while the generation waits, and ``ttft_ms`` counts from the request's
arrival. The engine is held by a job in the server's own scheduler (as a long earlier generation would
hold it) until the test has seen what it waits for; every timing below is an ordering check (the answer's
first token came after the test let the engine go), not a speed assertion."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk

from tests.app.browser import open_browser
from tests.app.live import DEADLINE_S, ThreadServer, engine_held, wait_for

pytestmark = pytest.mark.real_model

PING_S = 0.2
HOLD_S = 0.5  # how long the engine stays held once a test has seen its request wait


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"sse_ping_s": PING_S, "max_batch": 1}  # one generation at a time: a held engine makes others wait


def time_one_generation(server: ThreadServer) -> None:
    """One generation the server's scheduler times (a holder let go at once), so that every queued progress
    from here on carries an ``eta_s`` estimate."""
    with engine_held(server.services) as gate:
        gate.set()


def assert_queued_first_in_line_with_an_estimate(progress: dict[str, Any]) -> None:
    assert set(progress) == {"stage", "position", "eta_s"}, progress
    assert (progress["stage"], progress["position"]) == ("queued", 1)
    assert isinstance(progress["eta_s"], float) and progress["eta_s"] >= 0.0


def sse_frames(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) per frame of a raw text/event-stream; a comment frame is (":", its text)."""
    event, data = "message", list[str]()
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith(":"):
            yield ":", line[1:].strip()
        elif line.startswith("event:"):
            event = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:") :].strip())
    if data:
        yield event, "\n".join(data)


def test_ask_stream_pings_and_reports_its_place_before_a_slow_first_token(server: ThreadServer, doc: str) -> None:
    body = {"question": "When was the Eiffel Tower completed?", "document_ids": [doc], "max_tokens": 8,
            "stream": True}
    seen: list[tuple[str, str]] = []
    released_at = first_byte_at = None
    time_one_generation(server)
    held = engine_held(server.services)
    with held as gate, server.client() as client, client.stream("POST", "/v1/ask", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for event, data in sse_frames(r.iter_lines()):
            first_byte_at = first_byte_at or time.perf_counter()
            seen.append((event, data))
            pings = [d for e, d in seen if e == ":" and d == "ping"]
            queued = [d for e, d in seen if e == "progress" and json.loads(d)["stage"] == "queued"]
            if released_at is None and len(pings) >= 2 and queued:
                time.sleep(HOLD_S)  # the request waits on: its ttft must count this too
                released_at = time.perf_counter()
                gate.set()
    assert released_at is not None and first_byte_at is not None
    names = [e for e, _ in seen]
    assert seen[0] == (":", "accepted")  # the first bytes, before retrieval
    assert names[-2:] == ["stats", "done"]
    first_token = names.index("token")
    assert names.index("sources") < names.index("progress") < first_token
    progress = [json.loads(d) for e, d in seen if e == "progress"]
    assert_queued_first_in_line_with_an_estimate(progress[0])
    assert names[:first_token].count(":") >= 3  # "accepted" and at least two pings while it waited
    prefill = [p for p in progress if p["stage"] == "prefill"]
    assert prefill and all(set(p) == {"stage", "done", "total", "reused"} for p in prefill)
    stats = json.loads(dict(seen)["stats"])
    assert stats["ttft_ms"] >= (released_at - first_byte_at) * 1000  # from arrival, queue wait included


def test_openai_stream_pings_while_queued_and_the_official_client_still_parses_it(
    server: ThreadServer, doc: str
) -> None:
    body = {"model": "ragspec", "messages": [{"role": "user", "content": "How tall is the Eiffel Tower?"}],
            "document_ids": [doc], "max_tokens": 8, "stream": True}
    seen: list[tuple[str, str]] = []
    time_one_generation(server)
    with engine_held(server.services) as gate, server.client() as client, client.stream(
        "POST", "/v1/chat/completions", json=body
    ) as r:
        assert r.status_code == 200
        for event, data in sse_frames(r.iter_lines()):
            seen.append((event, data))
            if not gate.is_set() and sum(1 for e, d in seen if e == ":" and d == "ping") >= 2:
                gate.set()
    datas = [d for e, d in seen if e == "message"]
    assert json.loads(datas[0])["choices"][0]["delta"]["role"] == "assistant"  # the first frame
    assert seen[0][0] == "message" and datas[-1] == "[DONE]"
    comments = [d for e, d in seen if e == ":"]
    progress = [json.loads(d) for d in comments if d.startswith("{")]
    assert_queued_first_in_line_with_an_estimate(progress[0])
    assert any(p["stage"] == "prefill" for p in progress)

    openai = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=DEADLINE_S)
    with engine_held(server.services) as gate:
        stream = openai.chat.completions.create(
            model="ragspec", messages=[{"role": "user", "content": "How tall is the Eiffel Tower?"}],
            max_tokens=8, stream=True, extra_body={"document_ids": [doc]},
        )
        chunks: list[ChatCompletionChunk] = []
        for chunk in stream:  # the role chunk comes while the engine is held; pings and comments are skipped
            if not chunks:
                first_at = time.perf_counter()
                time.sleep(HOLD_S)
                released_at = time.perf_counter()
                gate.set()
            chunks.append(chunk)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    extra = chunks[-1].model_extra
    assert extra is not None
    stats = extra["stats"]
    assert stats["ttft_ms"] >= (released_at - first_at) * 1000


def test_json_answer_ttft_counts_the_wait_in_the_queue(server: ThreadServer, doc: str) -> None:
    scheduler = server.services.scheduler
    body = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 8}
    result: dict[str, httpx.Response] = {}
    with engine_held(server.services) as gate, server.client() as client:
        asker = threading.Thread(target=lambda: result.setdefault("r", client.post("/v1/ask", json=body)))
        asker.start()
        wait_for(lambda: scheduler.waiting == 1, "the question to wait in the queue", every_s=0.01)
        queued_at = time.perf_counter()  # it has arrived by now
        time.sleep(HOLD_S)
        released_at = time.perf_counter()
        gate.set()
        asker.join(DEADLINE_S)
    response = result["r"]
    assert response.status_code == 200, response.text
    assert response.json()["stats"]["ttft_ms"] >= (released_at - queued_at) * 1000


def test_a_stream_that_goes_away_while_queued_leaves_the_queue(server: ThreadServer, doc: str) -> None:
    scheduler = server.services.scheduler
    body = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 8, "stream": True}
    with engine_held(server.services):
        with server.client() as client, client.stream("POST", "/v1/ask", json=body) as r:
            for event, data in sse_frames(r.iter_lines()):
                if event == "progress" and json.loads(data)["stage"] == "queued":
                    break  # the client stops reading and closes the connection
        assert wait_for(lambda: scheduler.waiting == 0, "the abandoned question to leave the queue")
        assert scheduler.running  # the holder still runs: the question left without ever running


@pytest.mark.browser
def test_page_shows_its_place_in_the_queue_then_the_answer(server: ThreadServer, doc: str) -> None:
    """The page's own SSE reader over the same stream: pings are skipped, the queued progress shows as the
    status line (with the estimated wait: a generation has been timed) while the engine is held, and the
    answer follows once it is free."""
    time_one_generation(server)
    with open_browser() as browser:
        page = browser.page
        page.call("Page.navigate", url=server.url + "/")
        page.wait_for("document.documentElement.dataset.loaded === '1'", "the page loading its data")
        item = f"document.querySelector('#doc-list li.doc[data-id=\"{doc}\"]')"
        page.wait_for(f"!!{item}", "the document being listed")
        if not page.js(f"{item}.querySelector('.doc-check').checked"):
            page.js(f"{item}.querySelector('.doc-check').click()")
        page.js("document.getElementById('max-tokens').value = '8'")
        turn = "document.querySelector('#turns li.turn:last-child')"
        with engine_held(server.services) as gate:
            page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
            page.call("Input.insertText", text="When was the Eiffel Tower completed?")
            page.js("document.getElementById('ask-btn').click()")
            status = page.wait_for(
                f"{turn} && {turn}.querySelector('.answer-status').textContent.startsWith('Waiting for the model') "
                f"&& {turn}.querySelector('.answer-status').textContent",
                "the page to show the question waiting",
            )
            assert re.fullmatch(r"Waiting for the model: next in line \(about [1-9]\d* s\)…", status), status
            time.sleep(3 * PING_S)  # pings arrive while it waits: the page must ignore them
            assert page.js(f"{turn}.querySelector('.answer-text').textContent") == ""
            assert page.js(f"{turn}.dataset.state") == "streaming"
            gate.set()
            state = page.wait_for(
                f"{turn}.dataset.state !== 'streaming' && {turn}.dataset.state", "the answer finishing"
            )
        assert state == "done", page.js(f"{turn}.querySelector('.answer-status').textContent")
        assert page.js(f"{turn}.querySelector('.answer-text').textContent").strip()
        assert page.exceptions() == []


def test_a_question_too_long_for_the_window_is_a_400_before_any_stream(server: ThreadServer, doc: str) -> None:
    question = "9 " * 1900  # within the question's character limit, over the 1024-token test window
    ask = {"question": question, "document_ids": [doc], "max_tokens": 8, "stream": True}
    chat = {"messages": [{"role": "user", "content": question}], "document_ids": [doc], "max_tokens": 8,
            "stream": True}
    with server.client() as client:
        for path, body in (("/v1/ask", ask), ("/v1/chat/completions", chat)):
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["code"] == "context_too_long"
