"""Answers people can check: citations attributed after generation, highlighted supporting passages, PDF page
ranges and the sources of follow-up questions; first the attribution on its own, then over real HTTP (the
module's server, tests/app/conftest.py: bundled SmolLM2 + MiniLM)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from app.answering.citations import attribute, cite, sentences, with_markers
from app.schemas import Source
from tests.app.live import LIGHTHOUSE, upload_text, wait_indexed
from tests.conftest import make_pdf

ROME = "The Colosseum is an amphitheatre in Rome. Its construction began under the emperor Vespasian in 72 AD."
WORD_CHAR = re.compile(r"\w")


def _whole_words(text: str, start: int, end: int) -> bool:
    """``text[start:end]`` starts and ends on word edges (no partial-word match)."""
    inside = text[start:end]
    before = text[start - 1] if start > 0 else " "
    after = text[end] if end < len(text) else " "
    return (
        bool(inside.strip())
        and not (WORD_CHAR.match(before) and WORD_CHAR.match(inside[0]))
        and not (WORD_CHAR.match(after) and WORD_CHAR.match(inside[-1]))
    )


# ---- attribution on its own ------------------------------------------------------------------------


def test_each_sentence_is_cited_to_the_source_that_supports_it() -> None:
    answer = "The Colosseum's construction began under Vespasian in 72 AD. The lighthouse was automated in 1953."
    found = attribute(answer, [LIGHTHOUSE, ROME])
    cited = [(answer[a:b], j) for a, b, j, _support in found.citations]
    assert cited == [
        ("The Colosseum's construction began under Vespasian in 72 AD.", 1),
        ("The lighthouse was automated in 1953.", 0),
    ]
    assert with_markers(answer, found.citations) == (
        "The Colosseum's construction began under Vespasian in 72 AD.[2] The lighthouse was automated in 1953.[1]"
    )
    # the highlight is the source's sentence holding the claim, not every sentence naming the lighthouse
    assert [LIGHTHOUSE[a:b] for a, b in found.highlights[0]] == [
        "In 1953 the lighthouse was automated, and the keeper's cottage became a small museum."
    ]
    assert [ROME[a:b] for a, b in found.highlights[1]] == [
        "Its construction began under the emperor Vespasian in 72 AD."
    ]


def test_unsupported_sentences_get_no_citation() -> None:
    answer = (
        "I do not know. The lighthouse was painted blue by sailors from Norway in 1990. "
        "Museums are nice places to visit on weekends."
    )
    found = attribute(answer, [LIGHTHOUSE, ROME])
    assert found.citations == [] and found.highlights == [[], []]
    assert with_markers(answer, found.citations) == answer
    assert attribute("", [LIGHTHOUSE]).citations == [] and attribute("Yes.", []).citations == []


def test_a_claim_spread_over_sentences_highlights_each() -> None:
    answer = "The lighthouse of Varnholm was built in 1953, and it was automated in 1953."
    (citation,) = attribute(answer, [LIGHTHOUSE]).citations
    highlights = attribute(answer, [LIGHTHOUSE]).highlights[0]
    assert citation[:3] == (0, len(answer), 0)
    assert [LIGHTHOUSE[a:b] for a, b in highlights] == [
        "The lighthouse of Varnholm was built in 1872 by the engineer Ada Kessling.",
        "In 1953 the lighthouse was automated, and the keeper's cottage became a small museum.",
    ]


def test_spans_are_whole_words_and_the_answer_is_unchanged() -> None:
    text = "Ünïcode wörds: the Brücke was built in 1872 by Ada Kessling.\nIt spans the Fluß."
    answer = "  Die Brücke was built by Ada Kessling in 1872!\n\nIt spans the Fluß"
    sources = [Source(document_id="d", chunk_id="0", text=text, score=1, similarity=1, start=0, end=len(text))]
    out = cite(answer, sources)
    assert [answer[c.start : c.end] for c in out.citations] == [
        "Die Brücke was built by Ada Kessling in 1872!", "It spans the Fluß"
    ]
    assert out.cited_answer == "  Die Brücke was built by Ada Kessling in 1872![1]\n\nIt spans the Fluß[1]"
    assert re.sub(r"\[\d+\]", "", out.cited_answer) == answer
    assert sources[0].highlights == out.highlights[0] and out.highlights[0]
    for a, b in out.highlights[0]:
        assert _whole_words(text, a, b), text[a:b]
    for s in sentences(answer + " and 3.5 more. e"):
        assert _whole_words(answer + " and 3.5 more. e", s.start, s.end)


# ---- over HTTP -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lighthouse(client: httpx.Client) -> str:
    doc_id = upload_text(client, LIGHTHOUSE, title="Varnholm")
    assert wait_indexed(client, doc_id)["status"] == "ready"
    return doc_id


def _ask(client: httpx.Client, **body: Any) -> dict[str, Any]:
    body.setdefault("max_tokens", 40)
    response = client.post("/v1/ask", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _check_citations(answer: dict[str, Any]) -> None:
    text, sources = answer["answer"], answer["sources"]
    assert re.sub(r"\[\d+\]", "", answer["cited_answer"]) == text
    for c in answer["citations"]:
        assert 0 <= c["start"] < c["end"] <= len(text) and 0 <= c["source"] < len(sources)
        assert f"{text[c['start']:c['end']]}[{c['source'] + 1}]" in answer["cited_answer"]
        assert sources[c["source"]]["highlights"], "a cited source highlights what supports the sentence"
    for s in sources:
        for a, b in s["highlights"]:
            assert _whole_words(s["text"], a, b), s["text"][a:b]


@pytest.mark.real_model
def test_answers_carry_citations_and_the_stream_sends_them_before_stats(
    client: httpx.Client, lighthouse: str
) -> None:
    body = {"question": "Who built the lighthouse of Varnholm, and when?", "document_ids": [lighthouse]}
    answer = _ask(client, **body)
    _check_citations(answer)
    assert answer["citations"], answer  # the bundled model's greedy answer restates the source
    cited = {c["source"] for c in answer["citations"]}
    assert any("Kessling" in answer["sources"][j]["text"] for j in cited)

    with connect_sse(client, "POST", "/v1/ask", json={**body, "max_tokens": 40, "stream": True}) as stream:
        events = [(e.event, e.json() if e.data.startswith(("{", "[")) else e.data) for e in stream.iter_sse()]
    names = [name for name, _ in events if name != "progress"]
    assert names[0] == "sources" and names[-3:] == ["citations", "stats", "done"]
    assert set(names[1:-3]) == {"token"}
    tokens = "".join(data["text"] for name, data in events if name == "token")
    assert tokens == answer["answer"], "citations never change the generated text"
    (streamed,) = [data for name, data in events if name == "citations"]
    assert streamed["citations"] == answer["citations"] and streamed["cited_answer"] == answer["cited_answer"]
    assert streamed["highlights"] == [s["highlights"] for s in answer["sources"]]
    (first_sources,) = [data for name, data in events if name == "sources"]
    assert all(s["highlights"] == [] for s in first_sources)  # known only once the answer is


@pytest.mark.real_model
def test_follow_up_questions_return_their_sources(client: httpx.Client, lighthouse: str) -> None:
    follow_up = "And when was it automated?"
    alone = _ask(client, question=follow_up, document_ids=[lighthouse], max_tokens=4)
    assert alone["sources"] == [], "the follow-up alone names no subject: no passage passes the threshold"

    first = _ask(client, question="Who built the lighthouse of Varnholm?", document_ids=[lighthouse], max_tokens=8)
    assert first["sources"]
    second = _ask(client, question=follow_up, document_ids=[lighthouse], session_id=first["session_id"])
    assert second["sources"], "a follow-up in the session finds its passage through the conversation"
    assert any("automated" in s["text"] for s in second["sources"])
    _check_citations(second)
    # a follow-up may leave the documents out: the conversation's are used, and the answer is the same
    third = _ask(client, question=follow_up, session_id=first["session_id"])
    assert [s["chunk_id"] for s in third["sources"]] == [s["chunk_id"] for s in second["sources"]]
    assert {s["document_id"] for s in third["sources"]} == {lighthouse}
    nowhere = client.post("/v1/ask", json={"question": follow_up})
    assert nowhere.status_code == 422 and "document_ids" in nowhere.json()["error"]["message"]
    fresh = client.post("/v1/ask", json={"question": follow_up, "session_id": "never-asked-anything"})
    assert fresh.status_code == 422 and "never-asked-anything" in fresh.json()["error"]["message"]

    # the OpenAI route: the history comes in the messages
    chat = client.post("/v1/chat/completions", json={
        "messages": [
            {"role": "user", "content": "Who built the lighthouse of Varnholm?"},
            {"role": "assistant", "content": first["answer"]},
            {"role": "user", "content": follow_up},
        ],
        "document_ids": [lighthouse], "max_tokens": 40,
    }).json()
    assert chat["sources"] and "citations" in chat
    content = chat["choices"][0]["message"]["content"]
    assert "[1]" not in content or "[1]" in first["answer"]  # the content is the model's text, no markers
    for c in chat["citations"]:
        assert 0 <= c["start"] < c["end"] <= len(content) and 0 <= c["source"] < len(chat["sources"])
    with connect_sse(client, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Who built the lighthouse of Varnholm, and when?"}],
        "document_ids": [lighthouse], "max_tokens": 40, "stream": True,
    }) as stream:
        chunks = [e.json() for e in stream.iter_sse() if e.data != "[DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    last = chunks[-1]
    assert last["citations"] and last["sources"], "the last chunk carries the citations, content stays unmarked"
    for c in last["citations"]:
        assert last["sources"][c["source"]]["highlights"] and c["end"] <= len(streamed)
    assert "[1]" not in streamed


@pytest.mark.real_model
def test_pdf_sources_report_their_page_range(client: httpx.Client) -> None:
    pages = ["The harbour crane was built in 1921.", "It lifted ships of up to 80 tonnes.", "It was scrapped in 1988."]
    response = client.post(
        "/v1/documents", files={"file": ("crane.pdf", make_pdf(pages, title="Crane"), "application/pdf")}
    )
    assert response.status_code == 202, response.text
    doc_id = response.json()["id"]
    assert wait_indexed(client, doc_id)["status"] == "ready"
    answer = _ask(client, question="When was the harbour crane built and scrapped?", document_ids=[doc_id])
    (source,) = answer["sources"]
    assert (source["page"], source["page_end"]) == (1, 3)


def test_no_server_errors(client: httpx.Client) -> None:
    """Nothing above answered a 5xx (the module's server counts every response)."""
    text = client.get("/metrics").text
    requests = [line for line in text.splitlines() if line.startswith("ragspec_http_requests_total")]
    assert [line for line in requests if 'status="5' in line] == []
