"""A base model (a GGUF without a chat template) gets plain ``Context:`` / ``Question:`` / ``Answer:`` prompts, and its
answer ends where the layout's next turn would start, as a completion with a stop sequence does in llama.cpp: left
alone, the bundled model answering a follow-up in that layout goes on to ask and answer questions of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from app.answering.prompts import PromptBuilder, document_texts
from decoding.speculative.generation import DoneEvent, GenerationConfig
from decoding.speculative.prompt import PLAIN_TURN
from tests.app.live import LANDMARKS, ThreadServer, upload_text, wait_indexed

TURNS = ["When was the Eiffel Tower completed?", "How tall is it?", "Where is the Colosseum?"]


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"default_max_tokens": 64}


@pytest.fixture(scope="module")
def base_model(server: ThreadServer) -> Iterator[ThreadServer]:
    """The module's server with its prompts built as for a model without a chat template (its own copy of the
    tokenizer: the shared model is untouched)."""
    prompts = server.services.prompts
    template, prompts.tokenizer.chat_template = prompts.tokenizer.chat_template, None
    try:
        yield server
    finally:
        prompts.tokenizer.chat_template = template


def test_a_plain_prompt_stops_at_its_next_question(base_model: ThreadServer) -> None:
    services = base_model.services
    assert services.prompts.stops == (PLAIN_TURN,)
    with base_model.client() as http:
        doc = upload_text(http, LANDMARKS, title="Landmarks")
        assert wait_indexed(http, doc)["status"] == "ready"
    client = OpenAI(base_url=base_model.url + "/v1", api_key="any", max_retries=0)
    messages: list[Any] = []
    ran_on = 0
    for question in TURNS:
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model="ragspec", messages=messages, max_tokens=64,
                                           extra_body={"document_ids": [doc]})
        answer = r.choices[0].message.content or ""
        assert "Question:" not in answer, answer
        assert r.choices[0].finish_reason == "stop", answer
        # the same prompt without the layout's stop: the model's own continuation (what a user saw before)
        docs = document_texts(services.store, [services.store.get(doc)])
        prompt = services.prompts.fit(docs, question, _history(messages[:-1]), 64, None)
        done = next(e for e in services.engine.generate(prompt, GenerationConfig(max_new_tokens=64), [])
                    if isinstance(e, DoneEvent))
        ran_on += PLAIN_TURN in done.text
        messages.append({"role": "assistant", "content": answer})
    assert ran_on  # the stop mattered: unstopped, the model invents a next question


def _history(messages: list[Any]) -> list[tuple[str, str]]:
    return [(messages[i]["content"], messages[i + 1]["content"]) for i in range(0, len(messages) - 1, 2)]


def test_a_thinking_model_answers_straight_unless_the_setting_says(server: ThreadServer) -> None:
    """RAGSPEC_THINKING (off by default) reaches every chat template as ``enable_thinking`` (Qwen3's switch), as
    RAGSPEC_REASONING_EFFORT (low by default) does as ``reasoning_effort`` (harmony's: tests/app/test_harmony.py), and
    the prefix keys name them (a template may read them anywhere)."""
    prompts = server.services.prompts
    assert prompts.chat_options == {"enable_thinking": False, "reasoning_effort": "low"}
    assert prompts.channels is None  # SmolLM2's ChatML template: the answer is all the model writes
    assert prompts.key_for("s", ["d"]) != PromptBuilder(prompts.tokenizer, prompts.model_name, 512).key_for("s", ["d"])
