"""The QA set of the benchmarks: public texts in bench/data/ with hand-written questions.

``load_qa()`` returns every document with its questions; each question carries the passage that holds
its answer, located in the text as a character span (the quote in qa.json matches whitespace-, quote-
and apostrophe-insensitively, so line wrapping in the source does not matter).
Both the retrieval benchmark and the decoding benchmark use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
QA_FILE = DATA_DIR / "qa.json"
# The six licence / policy texts the decoding, eta and long-document benchmarks read (their published figures
# were measured on these; the retrieval benchmark reads every document).
DECODING_DOCS = ("gpl-3.0", "apache-2.0", "mpl-2.0", "gfdl-1.3", "lgpl-2.1", "debian-python-policy")

_EQUIVALENT = {"'": "['’‘]", "’": "['’‘]", '"': '["“”]', "“": '["“”]', "”": '["“”]'}


@dataclass(frozen=True)
class QAItem:
    """A question and the passage of the document that answers it: ``text[answer_start:answer_end]``."""

    question: str
    answer_passage: str
    answer_start: int
    answer_end: int
    held_out: bool = False  # kept out of every calibration (retrieval threshold, lexical weight)
    paraphrased: bool | None = None  # worded without the passage's distinctive terms (None: not labelled)


@dataclass(frozen=True)
class QADoc:
    doc_id: str
    title: str
    text: str
    questions: list[QAItem]
    source: str = ""
    filename: str = ""


def passage_pattern(quote: str) -> re.Pattern[str]:
    """A regex finding ``quote`` whatever the line breaks, spacing and quote characters in the text."""
    parts: list[str] = []
    for token in re.findall(r"\s+|.", quote.strip(), flags=re.DOTALL):
        if token.isspace():
            parts.append(r"\s+")
        else:
            parts.append(_EQUIVALENT.get(token, re.escape(token)))
    # "/ usr" in a quote also matches "/usr" and "/\nusr" (hard-wrapped paths)
    return re.compile("".join(parts).replace(r"/\s+", r"/\s*"))


def locate(text: str, quote: str) -> tuple[int, int]:
    """Character span of ``quote`` in ``text``; ValueError when absent or ambiguous."""
    matches = list(passage_pattern(quote).finditer(text))
    if len(matches) != 1:
        raise ValueError(f"passage found {len(matches)} times (want exactly once): {quote[:80]!r}")
    return matches[0].start(), matches[0].end()


@cache
def load_qa(path: Path = QA_FILE) -> list[QADoc]:
    """All QA documents with their questions (texts read from the files next to qa.json)."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    docs: list[QADoc] = []
    for entry in spec["documents"]:
        text = (path.parent / entry["file"]).read_text(encoding="utf-8")
        items = []
        for q in entry["questions"]:
            start, end = locate(text, q["answer"])
            items.append(QAItem(question=q["question"], answer_passage=text[start:end], answer_start=start,
                                answer_end=end, held_out=bool(q.get("held_out", False)),
                                paraphrased=q.get("paraphrased")))
        docs.append(QADoc(doc_id=entry["doc_id"], title=entry["title"], text=text, questions=items,
                          source=entry.get("source", ""), filename=entry["file"]))
    return docs
