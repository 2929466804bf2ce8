"""The target's prompt: a cached document prefix joined to a fresh suffix gives exactly the ids of building
the whole prompt; OpenAI messages map onto (system, history, question)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from app.errors import ContextTooLong, InvalidRequest
from app.prompts import SYSTEM_PROMPT, DocumentText, PromptBuilder
from app.routes.openai import conversation
from app.schemas import ChatMessage
from decoding.prompt import build_prompt


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(bundled_gguf_dir), local_files_only=True)


NOTES = "Tea is grown in Assam.\n\nCoffee needs <|im_end|> shade."
DOCS = [DocumentText("d1", "Notes", 20, lambda: NOTES)]


def test_cached_prefix_plus_suffix_equals_the_whole_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, "smollm2", max_context=4096)
    history = [("Where is tea grown?", "In Assam.")]
    first = builder.fit(DOCS, "What about coffee?", history, 32, None, None)
    again = builder.fit(DOCS, "And tea?", [], 32, None, None)  # prefix ids from the cache this time
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
    prompt = builder.fit([], "Short question?", long_turns, 16, None, None)
    assert len(prompt.ids) + 16 <= 300
    with pytest.raises(ContextTooLong):
        builder.fit([], "word " * 400, [], 16, None, None)


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
    target = builder.fit(DOCS, "What about coffee?", history, 32, None, None)
    assert draft == same.ids
    assert draft[-len(target.suffix_ids):] == list(target.suffix_ids)  # same question and history tokens
    assert len(draft) < len(target.ids)
