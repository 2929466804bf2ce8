"""A harmony model (gpt-oss's chat format) served: every API answers with the final channel alone, as it is written;
the analysis channel is the OpenAI chat API's ``reasoning_content`` and nowhere else; stop strings, ``max_tokens``,
log-probabilities, citations and the session's history are the answer's. The model is
``tests/decoding/harmony_script.py``'s: a one-layer Llama GGUF with the harmony test vocabulary and template whose
weights make it write an analysis message, then a final one, after any question."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse
from openai import OpenAI

from app.answering import pipeline as answering
from app.answering.pipeline import Question
from app.answering.prompts import document_texts
from app.settings import Settings
from decoding.runtime import kernels
from decoding.speculative.generation import SamplingParams
from retrieval.store import DEFAULT_TENANT
from tests.app.live import ThreadServer, ask
from tests.decoding.harmony_script import ANSWER, ANSWER_TEXT, OUTPUT_TOKENS, REASONING_TEXT, write_scripted_gguf

pytestmark = [pytest.mark.real_model,  # the harmony vocabulary extends the bundled SmolLM2's
              pytest.mark.skipif(kernels.load() is None, reason="no CPU kernels: no quantized runtime")]

GENERATED = len(OUTPUT_TOKENS) - 1  # every token the model writes but <|return|>, which ends it
QUESTION = "Where was it built?"


@pytest.fixture(scope="module")
def server_settings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = write_scripted_gguf(tmp_path_factory.mktemp("harmony-model"))
    return {"target_model": str(model), "default_max_tokens": 64}


@pytest.fixture(scope="module")
def openai(server: ThreadServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def chat(openai: OpenAI, doc: str, **kw: Any) -> Any:
    return openai.chat.completions.create(model="ragspec", messages=[{"role": "user", "content": QUESTION}],
                                          extra_body={"document_ids": [doc]}, **kw)


def test_the_chat_answer_is_the_final_channel_and_its_reasoning_comes_apart(openai: OpenAI, doc: str) -> None:
    r = chat(openai, doc, logprobs=True, top_logprobs=1)
    message = r.choices[0].message
    assert message.content == ANSWER_TEXT and message.model_extra["reasoning_content"] == REASONING_TEXT
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == GENERATED  # the reasoning's tokens count too
    assert [e.token for e in r.choices[0].logprobs.content] == [t.replace("\u0120", " ") for t in ANSWER]
    cited = r.model_extra["citations"]
    assert all(ANSWER_TEXT[c["start"]:c["end"]] for c in cited)  # spans of the answer's text


def test_the_chat_stream_sends_the_answer_as_content_and_the_reasoning_as_reasoning_content(
    openai: OpenAI, doc: str
) -> None:
    content, reasoning, logprobs = [], [], []
    for chunk in chat(openai, doc, stream=True, logprobs=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        assert not (delta.content and (delta.model_extra or {}).get("reasoning_content"))
        if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            logprobs += [e.token for e in chunk.choices[0].logprobs.content]
    assert "".join(content) == ANSWER_TEXT and "".join(reasoning) == REASONING_TEXT
    assert [i for i, r in enumerate(reasoning) if r] < [i for i, c in enumerate(content) if c]  # as written
    assert "".join(logprobs) == ANSWER_TEXT


def test_ask_and_its_stream_never_show_the_reasoning(client: httpx.Client, doc: str) -> None:
    body = ask(client, question=QUESTION, document_ids=[doc], max_tokens=64).json()
    assert body["answer"] == ANSWER_TEXT and body["usage"]["completion_tokens"] == GENERATED
    assert "xylograph" not in json.dumps(body)
    with connect_sse(client, "POST", "/v1/ask", json={"question": QUESTION, "document_ids": [doc],
                                                      "stream": True}) as source:
        events = list(source.iter_sse())
    tokens = [json.loads(e.data)["text"] for e in events if e.event == "token"]
    assert "".join(tokens) == ANSWER_TEXT  # as generated: accepted drafts bring several tokens a step
    assert not any("xylograph" in e.data for e in events)
    assert json.loads(events[-1].data)["finish_reason"] == "stop"


def test_running_out_inside_the_analysis_gives_an_empty_answer_cut_by_length(openai: OpenAI, client: httpx.Client,
                                                                           doc: str) -> None:
    r = chat(openai, doc, max_tokens=6)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("", "length")
    assert r.choices[0].message.model_extra["reasoning_content"] == " xylograph records say"
    body = ask(client, question=QUESTION, document_ids=[doc], max_tokens=6).json()
    assert body["answer"] == "" and body["stats"]["finish_reason"] == "length"


def test_stop_strings_cut_the_answer_not_the_reasoning(openai: OpenAI, doc: str) -> None:
    r = chat(openai, doc, stop=["records"])  # only in the reasoning
    assert r.choices[0].message.content == ANSWER_TEXT
    r = chat(openai, doc, stop=[" Paris"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("It was built in", "stop")

def test_the_pipeline_stops_the_generation_at_the_answers_stop_string(server: ThreadServer, doc: str) -> None:
    """A token a step (no drafts), the generation ends at the token that completes the stop string."""
    q = Question(question=QUESTION, document_ids=[doc], max_tokens=64, sampling=SamplingParams(), stop=(" Paris",),
                 mode="autoregressive")
    done = asyncio.run(answering.complete(answering.answer(server.services, DEFAULT_TENANT, q)))
    assert (done.text, done.finish_reason, done.reasoning) == ("It was built in", "stop", REASONING_TEXT)
    assert done.usage.completion_tokens == GENERATED - 1


def test_the_session_keeps_the_answer_and_the_prompt_renders_it_as_a_final_message(
    server: ThreadServer, client: httpx.Client, doc: str
) -> None:
    for question in (QUESTION, "And when?"):
        body = ask(client, question=question, document_ids=[doc], session_id="harmony", max_tokens=64).json()
        assert body["answer"] == ANSWER_TEXT
    turns = client.get("/v1/sessions/harmony").json()["turns"]
    assert [t["answer"] for t in turns] == [ANSWER_TEXT, ANSWER_TEXT]
    services = server.services
    docs = document_texts(services.store, [services.store.get(doc)])
    prompt = services.prompts.fit(docs, "And when?", [(QUESTION, ANSWER_TEXT)], 64, None)
    text = services.target.tokenizer.decode(prompt.ids)
    assert f"<|start|>assistant<|channel|>final<|message|>{ANSWER_TEXT}<|end|>" in text
    assert "\nReasoning: low\n" in text  # RAGSPEC_REASONING_EFFORT's default, through the services' prompts
    assert services.prompts.channels is not None


def test_the_responses_api_answers_with_the_final_channel(openai: OpenAI) -> None:
    r = openai.responses.create(model="ragspec", input=QUESTION)
    assert r.output_text == ANSWER_TEXT


def test_the_reasoning_effort_setting_reaches_the_template(monkeypatch: pytest.MonkeyPatch,
                                                           server: ThreadServer) -> None:
    from app.services import open_prompts

    tokenizer, keys = server.services.target.tokenizer, set()
    for value in ("high", "medium", "low"):
        monkeypatch.setenv("RAGSPEC_REASONING_EFFORT", value)
        prompts = open_prompts(Settings(), tokenizer, "m", 1024)  # type: ignore[call-arg]
        assert f"\nReasoning: {value}\n" in tokenizer.decode(prompts.fit([], "q", [], 8, None).ids)
        keys.add(prompts.key_for("s", ["d"]))
    assert len(keys) == 3  # each effort its own prefix KV: the system message before the document differs


def test_a_gpt_oss_gguf_with_harmonys_template_is_read_as_harmony(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The architecture and the format together: a tiny gpt-oss GGUF carrying the harmony vocabulary and template
    loads from the file alone with its answer read by channel (the prompt builder finds the markup), generation
    ending at <|return|> / <|call|> and never at <|end|>."""
    from app.answering.prompts import PromptBuilder
    from decoding.runtime.gguf.tokenizer import tokenizer_from_gguf
    from decoding.runtime.loader import LoadOptions, load_model
    from tests.decoding.conftest import make_tiny_family
    from tests.decoding.gguf_families import write_family_gguf
    from tests.decoding.runtime.gguf_vocabs import FAMILY_VOCAB, write_vocab

    root = tmp_path_factory.mktemp("gpt-oss-harmony")
    vocab = len(tokenizer_from_gguf(write_vocab(FAMILY_VOCAB["gpt-oss"], root)))
    path = write_family_gguf(root / "tiny-gpt-oss.gguf", make_tiny_family("gpt-oss", vocab=vocab),
                             vocab=FAMILY_VOCAB["gpt-oss"])
    loaded = load_model(str(path), LoadOptions())
    assert loaded.model.config.model_type == "gpt_oss"
    harmony = PromptBuilder(loaded.tokenizer, loaded.name, 512).channels
    assert harmony is not None
    ids = loaded.tokenizer.get_vocab()
    assert ids["<|return|>"] in loaded.eos_token_ids and ids["<|end|>"] not in loaded.eos_token_ids
    assert harmony.stops == {ids["<|return|>"], ids["<|call|>"]}
