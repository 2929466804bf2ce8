"""Asking and chatting over real HTTP: /v1/ask (JSON and SSE stream, every speculative mode answering like
autoregressive decoding, several documents, sampling, sessions, a document cut to the window, an index from
another embedder) and the OpenAI-compatible /v1/chat/completions through the official OpenAI client and a
real SSE parser (httpx-sse); bad ask and chat requests get a clear 4xx, and no request of the module's server
ends in a 5xx. One uvicorn server for the module (tests/app/conftest.py; bundled SmolLM2 + MiniLM, no auth,
no Redis), with small limits on questions and document lists.

Health, documents and uploads are in tests/app/test_api.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse
from openai import OpenAI

from decoding.drafters.registry import MODES
from tests.app.live import LANDMARKS, ThreadServer, ask, upload_text, wait_indexed

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_question_chars": 300, "max_document_ids": 3}


def sse_events(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with connect_sse(client, "POST", path, json=body) as source:
        return source.response, list(source.iter_sse())


# ---- ask ------------------------------------------------------------------------------------------


def test_ask_json(client: httpx.Client, doc: str) -> None:
    response = ask(client, question="When was the Eiffel Tower completed?", document_ids=[doc])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["answer"].strip()
    assert body["session_id"]
    source = body["sources"][0]
    assert set(source) == {
        "document_id", "title", "attributes", "chunk_id", "text", "score", "similarity", "start", "end", "page",
        "page_end", "highlights",
    }
    assert source["title"] == "Landmarks" and source["attributes"] == {}
    assert {"cited_answer", "citations"} <= set(body)  # tests/app/test_citations.py
    assert source["document_id"] == doc and LANDMARKS[source["start"] : source["end"]] == source["text"]
    assert 0 < body["usage"]["completion_tokens"] <= 12 and body["usage"]["prompt_tokens"] > 20
    stats = body["stats"]
    for key in (
        "ttft_ms",
        "tokens_per_second",
        "acceptance_length",
        "drafted",
        "accepted_by_source",
        "prefix_cache_hit",
        "context_truncated",
    ):
        assert key in stats
    assert stats["context_truncated"] is False and stats["acceptance_length"] >= 1.0


NODE_SOURCES = {  # the labels a drafter's nodes carry in the answer's stats
    "racer": ("racer.retrieval", "racer.logits", "racer.cross_session"),
    "prompt_lookup": ("prompt_lookup",),
    "suffix": ("suffix", "suffix.session"),
    "rapid": ("rapid",),
    "rapid_kv": ("rapid_kv",),
}


def test_speculative_modes_answer_like_autoregressive(client: httpx.Client, doc: str) -> None:
    """Greedy output is the target's whatever drafts: every mode equals autoregressive, token for token; the
    RAG drafter (rapid, combined) reads the retrieved chunks and its nodes are counted under its own name."""
    question = "How tall is the Eiffel Tower and when was it completed?"
    answers = {}
    for mode in ("autoregressive", "auto", "racer", "rapid", "rapid_kv", "combined"):
        response = ask(client, question=question, document_ids=[doc], mode=mode, max_tokens=24)
        assert response.status_code == 200, response.text
        answers[mode] = response.json()["answer"]
        stats = response.json()["stats"]
        assert stats["mode"] == mode
        # drafted nodes come from the mode's own drafters only (RACER's sources are racer.<part>); how many are
        # verified is the budget policy's call (it may verify none where drafts do not pay), but the KV-subset
        # drafter's first use is always tried; RAPID's LM reads its own prompt first, which a 24-token answer
        # never pays back, so it drafts nothing here. Every drafter that ran is timed.
        assert set(stats["drafted_by_source"]) <= {s for name in MODES[mode] for s in NODE_SOURCES[name]}, stats
        assert set(stats["drafting_ms"]) <= set(MODES[mode]) and all(v >= 0 for v in stats["drafting_ms"].values())
        if mode == "rapid_kv":
            assert stats["drafted"] > 0 and set(stats["drafted_by_source"]) == {mode} and stats["drafting_ms"][mode] > 0
        assert set(stats["accepted_by_source"]) <= set(stats["drafted_by_source"])
    assert len(set(answers.values())) == 1, answers


def test_ask_over_two_documents(client: httpx.Client, doc: str) -> None:
    other = upload_text(client, "Penguins live in Antarctica and cannot fly.", title="penguins")
    assert wait_indexed(client, other)["status"] == "ready"
    body = ask(client, question="Where do penguins live?", document_ids=[doc, other, doc]).json()
    assert body["answer"] and {s["document_id"] for s in body["sources"]} <= {doc, other}
    assert body["sources"][0]["document_id"] == other and "Penguins" in body["sources"][0]["text"]
    scores = [s["score"] for s in body["sources"]]
    assert scores == sorted(scores, reverse=True)  # best first
    assert all(s["similarity"] >= 0.3 for s in body["sources"])  # the threshold gates the similarity
    # the same documents named in the other order: the same prompt, so its prefix KV is reused, not recomputed
    again = ask(client, question="Where do penguins live?", document_ids=[other, doc]).json()
    assert again["answer"] == body["answer"] and again["stats"]["prefix_cache_hit"] is True
    assert again["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_sampling_with_a_seed_is_reproducible(client: httpx.Client, doc: str) -> None:
    body = {"question": "Tell me about the Colosseum.", "document_ids": [doc], "temperature": 0.9, "seed": 11}
    first, second = ask(client, **body).json(), ask(client, **body).json()
    assert first["answer"] == second["answer"] and first["answer"]


def test_knowledge_transfer_is_an_explicit_sampling_opt_in(client: httpx.Client, doc: str) -> None:
    """eta (not lossless) needs sampling without a seed and a mode with the RAG drafter; else 422."""
    base = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 6}
    sampled = {"eta": 10, "temperature": 0.7}
    for bad in ({"eta": 10}, {**sampled, "seed": 3}, {**sampled, "mode": "auto"}):
        response = ask(client, **base, **bad)
        assert response.status_code == 422 and "eta" in response.text
    response = ask(client, **base, eta=10, temperature=0.7, mode="rapid_kv")
    assert response.status_code == 200 and response.json()["answer"]


def test_a_top_p_that_rounds_to_zero_answers_with_the_top_token(client: httpx.Client, doc: str) -> None:
    base = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 6, "temperature": 1.0}
    greedy = ask(client, question=base["question"], document_ids=[doc], max_tokens=6).json()["answer"]
    for extra in ({}, {"seed": 5}):
        response = ask(client, **base, top_p=1e-46, **extra)
        assert response.status_code == 200, response.text
        assert response.json()["answer"] == greedy  # only the most likely token is left at every step


def test_unknown_mode_is_refused(client: httpx.Client, doc: str) -> None:
    response = ask(client, question="Where is the Colosseum?", document_ids=[doc], mode="fastest")
    assert response.status_code == 422
    assert "mode" in response.text


def test_ask_stream_events(client: httpx.Client, doc: str) -> None:
    question = "Where is the Colosseum?"
    plain = ask(client, question=question, document_ids=[doc]).json()
    response, events = sse_events(
        client, "/v1/ask", {"question": question, "document_ids": [doc], "max_tokens": 12, "stream": True}
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    names = [e.event for e in events]
    assert names[0] == "sources" and names[-3:] == ["citations", "stats", "done"]
    assert set(names[1:-3]) == {"progress", "token"}
    assert names.index("token") > max(i for i, n in enumerate(names) if n == "progress")  # the prompt first
    progress = [json.loads(e.data) for e in events if e.event == "progress"]
    assert progress[0]["stage"] == "prefill" and progress[0]["done"] == progress[0]["reused"] > 0  # cached
    assert all(p["total"] == plain["usage"]["prompt_tokens"] for p in progress)
    unmarked = [{**s, "highlights": []} for s in plain["sources"]]  # highlights come with the citations event
    assert json.loads(events[0].data) == unmarked
    streamed = "".join(json.loads(e.data)["text"] for e in events if e.event == "token")
    assert streamed == plain["answer"]  # greedy: the stream and the JSON answer are the same text
    stats = json.loads(events[-2].data)
    assert stats["prefix_cache_hit"] is True  # the document prefix was computed before
    assert json.loads(events[-1].data)["finish_reason"] in ("stop", "length")


def test_session_keeps_the_conversation(client: httpx.Client, doc: str) -> None:
    first = ask(client, question="Where is the Eiffel Tower?", document_ids=[doc], session_id="trip-1").json()
    assert first["session_id"] == "trip-1"
    follow = ask(client, question="And how tall is it?", document_ids=[doc], session_id="trip-1").json()
    alone = ask(client, question="And how tall is it?", document_ids=[doc]).json()
    # the follow-up carries the first turn (question and answer) in its prompt; a new session does not
    extra = follow["usage"]["prompt_tokens"] - alone["usage"]["prompt_tokens"]
    assert extra >= first["usage"]["completion_tokens"] + 5
    assert follow["stats"]["prefix_cache_hit"] is True  # history sits after the shared document prefix


def test_long_document_is_cut_to_the_window(client: httpx.Client) -> None:
    filler = "\n\n".join(f"Section {i}. The archive keeps ledger number {i} in room {i % 7}." for i in range(150))
    text = filler + "\n\nThe secret password of the archive is BLUE HERON."
    doc_id = upload_text(client, text, title="archive")
    assert wait_indexed(client, doc_id)["status"] == "ready"
    question = "What is the secret password of the archive?"
    body = ask(client, question=question, document_ids=[doc_id]).json()
    assert body["stats"]["context_truncated"] is True
    assert body["usage"]["prompt_tokens"] + 12 <= 1024  # the window of this server
    assert any("BLUE HERON" in s["text"] for s in body["sources"])
    # the chunks read are cached one by one: the same question again reuses the whole prefix and answers the
    # same (greedy); a related one reuses the chunks its selection starts with
    again = ask(client, question=question, document_ids=[doc_id]).json()
    assert again["answer"] == body["answer"]
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens - 40 < again["stats"]["prefix_reused_tokens"] < prompt_tokens
    related = ask(client, question="Which room keeps ledger number 3?", document_ids=[doc_id]).json()
    assert 0 < related["stats"]["prefix_reused_tokens"] <= again["stats"]["prefix_reused_tokens"]


def test_index_from_another_embedder_is_409_with_the_reindex_command(server: ThreadServer) -> None:
    with server.client() as client:
        doc_id = upload_text(client, "Owls hunt at night.", title="owls")
        assert wait_indexed(client, doc_id)["status"] == "ready"
        sidecar = server.settings.data_dir / "documents" / "docs" / doc_id / "derived" / "index" / "index.json"
        recorded = json.loads(sidecar.read_text())
        sidecar.write_text(json.dumps({**recorded, "embedder": "bge-m3 (dense)", "dim": 1024}))  # as if built
        response = ask(client, question="When do owls hunt?", document_ids=[doc_id])  # with another model
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "embedder_mismatch" and "ragspec reindex --all" in error["message"]


# ---- OpenAI-compatible ----------------------------------------------------------------------------


def test_openai_client_chat_completions(server: ThreadServer, doc: str) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data]
    messages: Any = [{"role": "user", "content": "In which city is the Eiffel Tower?"}]
    completion = client.chat.completions.create(
        model="ragspec", messages=messages, max_tokens=12, temperature=0, extra_body={"document_ids": [doc]}
    )
    answer = completion.choices[0].message.content
    assert answer and completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    sources = (completion.model_extra or {})["sources"]
    assert sources and sources[0]["document_id"] == doc

    stream = client.chat.completions.create(
        model="ragspec",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"document_ids": [doc]},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert (last.model_extra or {})["sources"] == sources


def test_chat_stop_strings(client: httpx.Client, doc: str) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "In which city is the Eiffel Tower?"}],
        "max_tokens": 16,
        "document_ids": [doc],
    }
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert "Paris" in full
    cut = client.post("/v1/chat/completions", json={**body, "stop": ["Paris"]}).json()["choices"][0]
    assert cut["message"]["content"] == full[: full.index("Paris")] and cut["finish_reason"] == "stop"
    assert client.post("/v1/chat/completions", json={**body, "stop": [""]}).status_code == 422


def test_chat_stream_ends_with_done_marker(client: httpx.Client, doc: str) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where is the Colosseum?"},
        ],
        "max_tokens": 6,
        "stream": True,
        "document_ids": [doc],
    }
    response, events = sse_events(client, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["x-accel-buffering"] == "no"
    assert events[-1].data == "[DONE]"
    final = json.loads(events[-2].data)
    assert final["choices"][0]["finish_reason"] in ("stop", "length") and final["sources"]


def test_chat_without_documents_and_with_history(client: httpx.Client) -> None:
    body = {
        "messages": [
            {"role": "user", "content": "Hi, I am Ann."},
            {"role": "assistant", "content": "Hello Ann!"},
            {"role": "user", "content": "What is my name?"},
        ],
        "max_tokens": 8,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["sources"] == [] and response.json()["choices"][0]["message"]["content"]


# ---- bad input: a clear 4xx, never a 5xx ----------------------------------------------------------


def test_bad_ask_requests(client: httpx.Client, doc: str) -> None:
    def check(body: Any, status: int, code: str | None = None, raw: bytes | None = None) -> None:
        if raw is not None:
            response = client.post("/v1/ask", content=raw, headers={"Content-Type": "application/json"})
        else:
            response = client.post("/v1/ask", json=body)
        assert response.status_code == status, (body, response.text)
        if code:
            assert response.json()["error"]["code"] == code

    ok = {"question": "Where is the Colosseum?", "document_ids": [doc]}
    check(None, 422, "invalid_request", raw=b'{"question": ')
    check({**ok, "question": ""}, 422)
    check({**ok, "question": "   "}, 422)
    check({**ok, "question": "why? " * 100}, 422, "invalid_request")  # over max_question_chars
    check({**ok, "document_ids": []}, 422)
    check({**ok, "document_ids": [doc, "b", "c", "d"]}, 422, "invalid_request")  # over max_document_ids
    check({**ok, "max_tokens": 0}, 422)
    check({**ok, "max_tokens": 100_000}, 422, "invalid_request")
    check({**ok, "temperature": -1}, 422)
    check({**ok, "top_p": 0}, 422)
    check({**ok, "mode": "fastest"}, 422)
    check({**ok, "session_id": "../../etc"}, 422)
    check({**ok, "unknown_field": 1}, 400, "unsupported_parameter")
    check({**ok, "logprobs": False, "top_logprobs": 2}, 422)
    check({**ok, "logit_bias": {"abc": 1}}, 422)
    check({**ok, "logit_bias": {"5": 101}}, 422)
    check({**ok, "logit_bias": {"49152": -5}}, 422, "invalid_request")  # past the bundled model's vocabulary
    check({**ok, "frequency_penalty": 2.5}, 422)
    check({**ok, "repetition_penalty": 0}, 422)
    check({**ok, "top_logprobs": 21, "logprobs": True}, 422)
    check({**ok, "document_ids": ["nope"]}, 404, "document_not_found")
    check({**ok, "document_ids": [doc, "0123456789abcdef0123456789abcdef"]}, 404, "document_not_found")
    check({**ok, "stream": True, "document_ids": ["nope"]}, 404)  # refused before any streaming


def test_bad_chat_requests(client: httpx.Client) -> None:
    def status(body: Any) -> int:
        return client.post("/v1/chat/completions", json=body).status_code

    assert status({"messages": []}) == 422
    assert status({"messages": [{"role": "assistant", "content": "hi"}]}) == 422
    assert status({"messages": [{"role": "wizard", "content": "hi"}]}) == 422
    assert status({"messages": [{"role": "user", "content": "hi"}], "document_ids": ["missing"]}) == 404
    assert status({"messages": [{"role": "user", "content": "hi"}], "n": 2}) == 422
    assert status({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}) == 422
    hi = [{"role": "user", "content": "hi"}]
    assert status({"messages": hi, "stream_options": {"include_usage": True}}) == 422  # needs stream: true
    assert status({"messages": hi, "stream": True, "stream_options": {"include_obfuscation": True}}) == 400


def test_parameters_we_do_not_implement_are_refused_by_name(client: httpx.Client) -> None:
    """A 400 naming the parameter (OpenAI's shape: type, param), never a silent ignore."""
    hi = [{"role": "user", "content": "hi"}]
    for name, value in (("tools", [{"type": "function", "function": {"name": "f"}}]),
                        ("response_format", {"type": "json_object"}), ("best_of", 2)):
        response = client.post("/v1/chat/completions", json={"messages": hi, name: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_parameter" and error["param"] == name and name in error["message"]
        assert error["type"] == "invalid_request_error"
    both = client.post("/v1/chat/completions", json={"messages": hi, "tools": [], "audio": {}}).json()["error"]
    assert "tools" in both["message"] and "audio" in both["message"]
    ok = client.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2, "user": "u-1", "n": 1})
    assert ok.status_code == 200, ok.text


# ---- penalties, logit bias, log-probabilities ------------------------------------------------------


SHAPED = {"frequency_penalty": 0.8, "presence_penalty": 0.3, "repetition_penalty": 1.15,
          "logit_bias": {"314": 2.0, "253": -3.0}}


def test_speculative_modes_answer_like_autoregressive_with_penalties(client: httpx.Client, doc: str) -> None:
    """Penalties and a logit bias change the answer, and every mode still equals autoregressive decoding with the
    same parameters, token for token; so do the log-probabilities."""
    question = "Describe the Eiffel Tower and the Colosseum."
    base = {"question": question, "document_ids": [doc], "max_tokens": 40, "logprobs": True, "top_logprobs": 2}
    plain = ask(client, **base, mode="autoregressive", frequency_penalty=0).json()
    shaped = {}
    for mode in ("autoregressive", "auto", "racer", "rapid", "rapid_kv", "combined"):
        response = ask(client, **base, **SHAPED, mode=mode)
        assert response.status_code == 200, response.text
        shaped[mode] = response.json()
        assert shaped[mode]["usage"]["completion_tokens"] == len(shaped[mode]["logprobs"])
    reference = shaped["autoregressive"]
    assert reference["answer"] != plain["answer"]
    for mode, body in shaped.items():
        assert body["answer"] == reference["answer"], mode
        assert body["logprobs"] == reference["logprobs"], mode
    assert b"".join(bytes(t["bytes"]) for t in reference["logprobs"]).decode() == reference["answer"]
    for token in reference["logprobs"]:  # greedy: the emitted token is the most likely one
        assert len(token["top_logprobs"]) == 2 and token["top_logprobs"][0]["token"] == token["token"]
        assert token["logprob"] == token["top_logprobs"][0]["logprob"] <= 0.0


def test_seeded_sampling_with_penalties_is_the_same_in_every_mode(client: httpx.Client, doc: str) -> None:
    base = {"question": "Tell me about the Colosseum.", "document_ids": [doc], "max_tokens": 32, "temperature": 0.9,
            "seed": 5, "top_k": 40, "min_p": 0.02, "frequency_penalty": 0.7, "presence_penalty": 0.2,
            "logit_bias": {"314": 1.5}}
    answers = {mode: ask(client, **base, mode=mode).json()["answer"]
               for mode in ("autoregressive", "auto", "racer", "rapid_kv", "combined")}
    assert len(set(answers.values())) == 1, answers
    unshaped = {**base, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
    assert answers["auto"] != ask(client, **unshaped, mode="auto").json()["answer"]


def test_the_server_default_penalty_applies_to_requests_that_give_none(client: httpx.Client, doc: str) -> None:
    """RAGSPEC_DEFAULT_FREQUENCY_PENALTY (1.0 by default: bench.penalties) stands in for a penalty left out."""
    base = {"question": "Describe the Eiffel Tower and the Colosseum.", "document_ids": [doc], "max_tokens": 48}
    default, explicit = ask(client, **base).json(), ask(client, **base, frequency_penalty=1.0).json()
    off = ask(client, **base, frequency_penalty=0).json()
    assert default["answer"] == explicit["answer"] != off["answer"]


def test_ask_stream_carries_each_tokens_logprobs(client: httpx.Client, doc: str) -> None:
    body = {"question": "Where is the Colosseum?", "document_ids": [doc], "max_tokens": 12, "logprobs": True}
    whole = ask(client, **body).json()
    _, events = sse_events(client, "/v1/ask", {**body, "stream": True})
    streamed = [t for e in events if e.event == "token" for t in json.loads(e.data)["logprobs"]]
    assert streamed == whole["logprobs"] and all(t["top_logprobs"] == [] for t in streamed)
    assert ask(client, question="Where is the Colosseum?", document_ids=[doc], max_tokens=4).json()["logprobs"] is None


def test_openai_client_round_trips_logprobs_penalties_and_usage(server: ThreadServer, doc: str) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Describe the Eiffel Tower."}]
    common: Any = {"model": "ragspec", "messages": messages, "max_tokens": 48, "temperature": 0,
                   "extra_body": {"document_ids": [doc]}}
    plain = client.chat.completions.create(**common, frequency_penalty=0)
    completion = client.chat.completions.create(**common, frequency_penalty=1.5, logprobs=True, top_logprobs=3)
    choice = completion.choices[0]
    assert choice.message.content != plain.choices[0].message.content  # the penalty acted
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = choice.logprobs.content
    assert completion.usage is not None and len(tokens) == completion.usage.completion_tokens
    assert "".join(t.token for t in tokens) == choice.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in tokens)
    assert plain.choices[0].logprobs is None

    stream = client.chat.completions.create(**common, frequency_penalty=1.5, logprobs=True, top_logprobs=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in tokens]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_no_server_errors_so_far(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    server_errors = [
        line for line in text.splitlines() if line.startswith("ragspec_http_requests_total") and 'status="5' in line
    ]
    assert server_errors == []
