"""The target's prompt: a cached document prefix joined to a fresh suffix gives exactly the ids of building
the whole prompt; OpenAI messages map onto (system, history, question)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from app.answering.prompts import SYSTEM_PROMPT, DocumentText, PromptBuilder
from app.api.routes.openai import conversation
from app.errors import InvalidRequest
from app.schemas import ChatMessage
from decoding.errors import ContextTooLong
from decoding.speculative.prompt import build_prompt
from retrieval.retriever import Hit


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(bundled_gguf_dir), local_files_only=True)


NOTES = "Tea is grown in Assam.\n\nCoffee needs <|im_end|> shade."
DOCS = [DocumentText("d1", "Notes", 20, lambda: NOTES)]


def test_cached_prefix_plus_suffix_equals_the_whole_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, "smollm2", max_context=4096)
    history = [("Where is tea grown?", "In Assam.")]
    first = builder.fit(DOCS, "What about coffee?", history, 32, None)
    again = builder.fit(DOCS, "And tea?", [], 32, None)  # prefix ids from the cache this time
    for prompt, question, hist in ((first, "What about coffee?", history), (again, "And tea?", [])):
        whole = build_prompt(
            tokenizer,
            system=SYSTEM_PROMPT,
            document=NOTES,
            question=question,
            history=hist,
            prefix_key=prompt.prefix_key,
        )
        assert prompt.ids == whole.ids
        assert list(prompt.prefix_ids) == list(whole.prefix_ids)
    assert first.prefix_key == again.prefix_key and first.prefix_key is not None
    assert not first.context_truncated


def test_history_is_dropped_before_the_question_is_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, "smollm2", max_context=300)
    long_turns = [("q " * 60, "a " * 60)] * 3
    prompt = builder.fit([], "Short question?", long_turns, 16, None)
    assert len(prompt.ids) + 16 <= 300
    with pytest.raises(ContextTooLong):
        builder.fit([], "word " * 400, [], 16, None)


def test_a_long_history_is_trimmed_with_a_few_prompt_builds(tokenizer, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The oldest turns go first, as many as needed and no more; the count is found by bisection (300 turns:
    a handful of builds, not one per dropped turn)."""
    builder = PromptBuilder(tokenizer, "smollm2", max_context=600)
    turns = [(f"Question {i} about tea?", f"Answer {i}: tea grows in Assam, batch {i}.") for i in range(300)]
    builds = []
    real = builder._build
    monkeypatch.setattr(builder, "_build", lambda *a, **k: builds.append(1) or real(*a, **k))
    prompt = builder.fit([], "And coffee?", turns, 16, None)
    assert len(builds) <= 12
    assert len(prompt.ids) + 16 <= 600
    kept = [t for t in turns if f"Question {turns.index(t)} about" in tokenizer.decode(prompt.ids)]
    assert kept and kept == turns[-len(kept):]  # the most recent turns
    one_more = build_prompt(tokenizer, system=SYSTEM_PROMPT, document="", question="And coffee?",
                            history=turns[-len(kept) - 1:], prefix_key=None)
    assert len(one_more.ids) + 16 > 600  # keeping one more turn would not fit


def msg(role: str, content: str) -> ChatMessage:
    return ChatMessage(role=role, content=content)  # type: ignore[arg-type]


def test_conversation_from_messages() -> None:
    system, history, question = conversation(
        [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello"), msg("user", "Bye")]
    )
    assert (system, history, question) == ("Be brief.", [("Hi", "Hello")], "Bye")
    _, history, question = conversation([msg("user", "One."), msg("user", "Two?")])
    assert history == [] and question == "One.\n\nTwo?"
    with pytest.raises(InvalidRequest):
        conversation([msg("user", "Hi"), msg("assistant", "Hello")])


def test_draft_prompt_is_the_target_layout_over_the_retrieved_chunks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """RAPID's drafter reads [system][retrieved chunks][history][question] through the same template."""
    builder = PromptBuilder(tokenizer, "smollm2", max_context=4096)
    history = [("Where is tea grown?", "In Assam.")]
    draft = builder.draft_prompt("Coffee needs shade.", "What about coffee?", history)
    same = build_prompt(tokenizer, system=SYSTEM_PROMPT, document="Coffee needs shade.", question="What about coffee?",
                        history=history, prefix_key=None)
    target = builder.fit(DOCS, "What about coffee?", history, 32, None)
    assert draft == same.ids
    assert draft[-len(target.suffix_ids):] == list(target.suffix_ids)  # same question and history tokens
    assert len(draft) < len(target.ids)


def test_draft_rows_cover_the_retrieved_spans_and_the_prompt_around_the_document(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """RAPID-KV reads the target's cached rows of the system part, the retrieved chunks and the question."""
    text = "Tea is grown in Assam. " * 20 + "Coffee needs shade and rain. " + "Cocoa grows near the equator. " * 20
    docs = [DocumentText("d1", "Notes", 200, lambda: text)]
    builder = PromptBuilder(tokenizer, "smollm2", max_context=4096)
    prompt = builder.fit(docs, "What does coffee need?", [], 32, None)
    start = text.index("Coffee")
    hit = Hit("d1", 3, "Coffee needs shade and rain. ", 0.9, start, start + 29, None, 7)
    rows = builder.draft_rows(prompt, docs, [hit])
    assert rows[0][0] == 0 and rows[-1][1] == len(prompt.ids)
    assert len(rows) == 3  # system part, the chunk, the question part
    chunk = tokenizer.decode(prompt.ids[rows[1][0] : rows[1][1]])
    assert "Coffee needs shade and rain" in chunk and "Tea" not in chunk and "Cocoa" not in chunk
    assert tokenizer.decode(prompt.ids[rows[0][1] - 3 : rows[0][1]]).strip() != "Tea is grown"  # before the text
    assert "What does coffee need?" in tokenizer.decode(prompt.ids[rows[2][0] : rows[2][1]])
    assert sum(b - a for a, b in rows) < len(prompt.ids) // 3
