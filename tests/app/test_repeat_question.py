"""The default mode drafts a repeated question's answer from the tenant's cross-session tier, over real HTTP."""

from __future__ import annotations

import httpx

QUESTION = "How tall is the Eiffel Tower and when was it completed?"


def test_a_repeated_question_is_drafted_from_the_tenants_earlier_answer(client: httpx.Client, doc: str) -> None:
    body = {"question": QUESTION, "document_ids": [doc], "max_tokens": 32}  # mode: the default (auto)
    first = client.post("/v1/ask", json=body)
    assert first.status_code == 200, first.text
    assert first.json()["stats"]["mode"] == "auto"
    assert first.json()["stats"]["accepted_by_source"].get("suffix.session", 0) == 0  # nothing learned yet
    again = client.post("/v1/ask", json=body)  # the service fed the tier with the first answer
    assert again.status_code == 200, again.text
    assert again.json()["answer"] == first.json()["answer"]
    stats = again.json()["stats"]
    assert stats["accepted_by_source"].get("suffix.session", 0) > 0  # the earlier answer, matched exactly
    assert stats["acceptance_length"] > first.json()["stats"]["acceptance_length"]
