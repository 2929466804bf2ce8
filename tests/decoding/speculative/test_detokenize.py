"""Incremental detokenization on the real SmolLM2 tokenizer: no broken characters, no lost spaces."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from decoding.speculative.detokenize import IncrementalDetokenizer, StopMatcher

TEXTS = [
    "Hello world, this is a test.  Two spaces and\nnew lines\n\n  indented.",
    "Unicode: naïve café — ünïcödé, 日本語のテキスト, emoji 🚀🎉 and math ∑∫√.",
    " leading space, trailing space ",
]


@pytest.fixture(scope="module")
def tokenizer(bundled_gguf_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(bundled_gguf_dir))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_deltas_concatenate_to_full_decode(tokenizer, text: str, step: int) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_partial_stop() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abc E") == "abc "
    assert m.feed("N") == ""
    assert m.feed("X more") == "ENX more"
    assert m.feed(" the END is near") == " the "
    assert m.stopped
    assert m.text == "abc ENX more the "
    assert m.feed("ignored") == ""


def test_stop_matcher_without_stops_and_finish() -> None:
    m = StopMatcher([])
    assert m.feed("a") == "a"
    m2 = StopMatcher(["xyz"])
    assert m2.feed("abx") == "ab"
    assert m2.finish() == "x"
