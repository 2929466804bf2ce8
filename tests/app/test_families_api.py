"""Bring your own model, every family through the real API: a tiny random model of each architecture the CPU
runtime runs (``make_tiny_family``: Llama, Mistral, Qwen 2 / 3, Qwen3-MoE, gpt-oss, Gemma 2 / 3, Phi-3) written to a
GGUF as llama.cpp's converter writes it (``tests/decoding/gguf_families.py``, Q8_0) with a tokenizer of the family's
kind in it (Llama 3's, Qwen's, Gemma's, Mistral's, Phi-3's: ``gguf_vocabs``) and served with
``RAGSPEC_TARGET_MODEL=file.gguf`` alone: a document uploaded and indexed, a question answered over SSE, a
follow-up in the session, and every speculative mode answering as autoregressive decoding does, token for token,
with prompts longer than the sliding windows. Tokens are compared, not text: a random model's byte tokens need not
form UTF-8, and the text of such runs depends on how the tokens were grouped as they streamed. One uvicorn server
per architecture."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from decoding.runtime.gguf.tokenizer import end_of_turn_ids, tokenizer_from_gguf
from tests.app.live import ThreadServer, ask, service_settings, upload_text, wait_indexed
from tests.decoding.conftest import make_tiny_family, make_tokenizer
from tests.decoding.gguf_families import write_family_gguf
from tests.decoding.runtime.gguf_vocabs import FAMILY_VOCAB, write_vocab

pytestmark = pytest.mark.real_model

ARCHS = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3moe", "olmoe", "gpt-oss", "gemma2", "gemma3",
         "phi3"]
# gpt-oss's harmony template makes the answer its final channel alone, which a random model never opens: here its
# architecture serves with a ChatML vocabulary (every token the answer); harmony itself is served in test_harmony.py
VOCAB = {**FAMILY_VOCAB, "gpt-oss": "qwen2"}
DOCUMENT = ("The lighthouse on the northern cape was built in 1874 from granite quarried nearby. Its lamp burned "
            "whale oil until 1902, then kerosene, and an electric beam since 1951. The keeper's house holds a small "
            "museum of charts, logbooks and the original Fresnel lens.")




@pytest.fixture(scope="module", params=ARCHS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """The file alone: its tokenizer, chat template and end-of-turn tokens are the GGUF's own."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"byo-{arch}")
    tokenizer = tokenizer_from_gguf(write_vocab(VOCAB[arch], root))
    hf = make_tiny_family(arch, seed=11, vocab=len(tokenizer), layers=6 if arch == "gemma3" else 3,
                          window=None if arch == "mistral" else 72)  # Mistral's GGUF holds no window
    gguf = write_family_gguf(root / f"tiny-{arch}.Q8_0.gguf", hf, vocab=VOCAB[arch])
    server = ThreadServer(service_settings(root / "data", target_model=str(gguf), max_context=512))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            yield arch, (client, end_of_turn_ids(gguf))
    finally:
        server.stop()


def test_a_family_serves_upload_ask_stream_and_follow_up(served: tuple[str, Any]) -> None:
    arch, (client, ends) = served
    capabilities = client.get("/v1/capabilities").json()["model"]
    assert capabilities["runtime"].startswith("cpu-quantized:gguf:") and capabilities["name"].startswith("tiny-")
    doc = upload_text(client, DOCUMENT, title="lighthouse")
    assert wait_indexed(client, doc)["status"] == "ready"
    body: dict[str, Any] = {"question": "When was the lighthouse built?", "document_ids": [doc], "max_tokens": 16,
                            "logit_bias": {str(i): -100 for i in ends}}  # a random model: answers run their full length
    plain = ask(client, **body, session_id=f"s-{arch}").json()
    assert plain["usage"]["completion_tokens"] == 16 and plain["usage"]["prompt_tokens"] > 72, plain  # past a window
    with connect_sse(client, "POST", "/v1/ask", json={**body, "stream": True, "logprobs": True}) as source:
        events = list(source.iter_sse())
    assert [e.event for e in events][-1] == "done"
    # the same tokens (a random model's byte tokens need not form UTF-8, whose text a stream cannot match)
    streamed = [t["bytes"] for e in events if e.event == "token" for t in json.loads(e.data)["logprobs"]]
    whole = ask(client, **body, logprobs=True).json()
    assert streamed == [t["bytes"] for t in whole["logprobs"]] and len(streamed) == 16
    follow = ask(client, **{**body, "question": "And its lamp?"}, session_id=f"s-{arch}").json()
    alone = ask(client, **{**body, "question": "And its lamp?"}).json()
    assert follow["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"]  # the first turn is in the prompt


def test_every_mode_answers_as_autoregressive(served: tuple[str, Any]) -> None:
    arch, (client, ends) = served
    doc = upload_text(client, DOCUMENT * 2, title="lighthouse twice")
    assert wait_indexed(client, doc)["status"] == "ready"
    answers = {}
    for mode in ("autoregressive", "auto", "racer", "rapid", "rapid_kv", "combined"):
        response = ask(client, question="What does the keeper's house hold?", document_ids=[doc], mode=mode,
                       max_tokens=24, logit_bias={str(i): -100 for i in ends}, logprobs=True)
        assert response.status_code == 200, response.text
        answers[mode] = tuple(tuple(t["bytes"]) for t in response.json()["logprobs"])  # the tokens, as bytes
    assert len(set(answers.values())) == 1 and len(answers["auto"]) == 24, (arch, answers)


def test_rapid_drafts_with_a_smaller_model_of_the_family(tmp_path: Path) -> None:
    """RAGSPEC_DRAFTER_MODEL names a smaller GGUF of the target's family (one layer, a narrower model, its logits
    padded by 64 rows as the small models of a family often are): the vocabularies are accepted, RAPID drafts
    from it (its nodes counted under rapid) and the answer is the target's alone."""
    tokenizer = make_tokenizer()
    for name, layers, hidden, vocab in (("target", 3, 128, len(tokenizer)), ("drafter", 1, 64, len(tokenizer) + 64)):
        tokenizer.save_pretrained(tmp_path / name)
        hf = make_tiny_family("qwen2", seed=13, vocab=vocab, layers=layers, hidden_size=hidden,
                              eos_token_id=tokenizer.eos_token_id)
        write_family_gguf(tmp_path / name / f"tiny-qwen2-{name}.gguf", hf, eos=tokenizer.eos_token_id)
    settings = service_settings(tmp_path / "data", target_model=str(tmp_path / "target"),
                                drafter_model=str(tmp_path / "drafter"), max_context=512, max_new_tokens=160)
    server = ThreadServer(settings)
    try:
        assert server.services.drafters.config.draft_model is not server.services.target.model  # its own weights
        with httpx.Client(base_url=server.url, timeout=120) as client:
            doc = upload_text(client, DOCUMENT, title="lighthouse")
            assert wait_indexed(client, doc)["status"] == "ready"
            # an answer long enough for the drafter LM's own prefill to pay back (the engine grants it only then)
            body = {"question": "What burned in the lamp?", "document_ids": [doc], "max_tokens": 160,
                    "logit_bias": {str(tokenizer.eos_token_id): -100}}
            plain = ask(client, **body, mode="autoregressive").json()
            rapid = ask(client, **body, mode="rapid").json()
    finally:
        server.stop()
    assert rapid["answer"] == plain["answer"], (plain, rapid)
    assert rapid["stats"]["drafted"] > 0 and set(rapid["stats"]["drafted_by_source"]) == {"rapid"}
