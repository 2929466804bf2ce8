"""bench.decode's prompts: long-document QA cases, and the RAG drafter's context as the service picks it."""


from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import DocQA
from bench.decode_methods import RAPID_BUDGET, RAPID_SWEEP, SYSTEM, Case
from decoding.runtime.loader import LoadedModel
from decoding.speculative.prompt import build_prompt, context_rows
from retrieval.retriever import Hit, join_hits

# ---- prompts ----------------------------------------------------------------------------------------


class RagContext:
    """The RAG drafter's context for a question, as the service picks it: the document ingested into a document
    store (512-token chunks, the bundled embedder) and ranked by the service's retriever with its default
    scoring, threshold and top-k; the best that fit the budget, in document order."""

    def __init__(self, tokenizer: Any) -> None:
        import tempfile

        from retrieval.embedding import load_embedder
        from retrieval.retriever import Retriever
        from retrieval.store import DocumentStore

        self.tokenizer = tokenizer
        self.embedder = load_embedder("bundled", device="cpu")
        self._dir = tempfile.TemporaryDirectory(prefix="ragspec-bench-rag-")
        self.store = DocumentStore(Path(self._dir.name))
        self.retriever = Retriever(self.store, self.embedder)
        self._ids: dict[str, str] = {}

    def text(self, document: str, question: str, budget: int, top_k: int = 16) -> str:
        return join_hits(self.hits(document, question, budget, top_k))

    def hits(self, document: str, question: str, budget: int, top_k: int = 16) -> list[Hit]:
        if document not in self._ids:
            record = self.store.create(None, "bench", "doc.txt", "text/plain", document.encode("utf-8"))
            self.store.ingest(record.id, self.tokenizer, self.embedder, 512)
            self._ids[document] = record.id
        doc_id = self._ids[document]
        return self.retriever.retrieve(question, [doc_id], top_k=top_k, budget_tokens=budget).hits


def make_cases(
    target: LoadedModel,
    docs: Sequence[DocQA],
    questions_per_doc: int,
    max_new: int,
    max_doc_tokens: int | None = None,
    min_doc_tokens: int = 0,
    rag: RagContext | None = None,
) -> list[Case]:
    """One case per (document, question); documents longer than the window (or the cap) are cut, documents
    shorter than ``min_doc_tokens`` left out. With ``rag``, each case carries the RAG drafter's prompts."""
    tok = target.tokenizer
    room = min(target.max_context - max_new - 256, max_doc_tokens or target.max_context)
    cases = []
    for doc in docs:
        text = doc.text
        ids = tok(text, add_special_tokens=False).input_ids
        if len(ids) < min_doc_tokens:
            continue
        if len(ids) > room:
            text = tok.decode(ids[:room])
            text = text[: text.rfind("\n\n")] if "\n\n" in text else text
        tag = f"@{max_doc_tokens}" if max_doc_tokens else ""
        for i, question in enumerate(doc.questions[:questions_per_doc]):
            prompt = build_prompt(tok, system=SYSTEM, document=text, question=question, prefix_key=doc.name + tag)
            drafts = {}
            for budget in (RAPID_BUDGET, *RAPID_SWEEP) if rag is not None else ():
                context = rag.text(text, question, budget)  # type: ignore[union-attr]
                drafts[budget] = build_prompt(tok, system=SYSTEM, document=context, question=question,
                                              prefix_key=None).ids
            rows = None
            if rag is not None:
                spans = [(h.start, h.end) for h in rag.hits(text, question, RAPID_BUDGET)]
                rows = context_rows(tok, prompt, text, spans)
            prompt = dataclasses.replace(prompt, draft_ids=drafts.get(RAPID_BUDGET), draft_rows=rows)
            cases.append(Case(f"{doc.name}/q{i + 1}{tag}", text, question, prompt, max_doc_tokens or 0, drafts))
    return cases

