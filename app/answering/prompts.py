"""The target's prompt: whole document(s) + question, fitted to the window.

Layout ``[system][document][history][question]`` through ``decoding.speculative.prompt.build_prompt``. The prefix
(system + document) never depends on the question, so its token ids are cached here per prefix key and
its KV by the engine's prefix cache. When the documents do not fit the target's window (minus the
question, history and ``max_tokens``), the target reads the most relevant chunks that fit, in document
order (``Ranking.window``, cut from the request's one ranking) after a fixed lead of the documents'
beginning, and the prompt is marked ``context_truncated``. Such a prefix depends on the question, so it is
cached chunk by chunk: every chunk is a segment of the prefix (``Prompt.segment_ends``), and a later question
whose selection starts with the same chunks reuses their KV (the lead always; the whole prefix for a repeated
question).

The tokenizer is used from one thread at a time here (fast tokenizers toggle backend state per call),
with a private copy so indexing and detokenizing elsewhere never race with it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import cached_property, partial
from typing import Any

from decoding.errors import ContextTooLong
from decoding.speculative.channels import Harmony, harmony_of
from decoding.speculative.generation import Prompt
from decoding.speculative.prompt import build_prompt, context_rows, turn_stops
from retrieval.retriever import Hit, Ranking, Retriever, hit_pieces
from retrieval.store import DocumentRecord, DocumentStore

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a careful assistant. Answer the user's question using the documents below. "
    "If the documents do not contain the answer, say so."
)
DOCUMENT_SEPARATOR = "\n\n"
FIT_ATTEMPTS = 4
LENGTH_SLACK = 64  # the prompt's document tokens may differ a little from the indexing count


class DocumentText:
    """A document for the prompt; its text is read from the store only when a prefix must be tokenized."""

    def __init__(self, id: str, title: str, n_tokens: int, read: Callable[[], str]) -> None:
        self.id = id
        self.title = title
        self.n_tokens = n_tokens  # target tokens of the text (counted at indexing)
        self._read = read

    @cached_property
    def text(self) -> str:
        return self._read()


def prefix_key(model_name: str, system: str, doc_ids: Sequence[str]) -> str:
    """Names the ``[system][document]`` prefix: shared by every question and session over these documents."""
    h = hashlib.sha256()
    for part in (model_name, system, *doc_ids):
        h.update(part.encode())
        h.update(b"\0")
    return "kv-" + h.hexdigest()[:32]


def join_documents(docs: Sequence[DocumentText]) -> str:
    if len(docs) == 1:
        return docs[0].text
    return DOCUMENT_SEPARATOR.join(f"Document: {d.title}\n\n{d.text}" for d in docs)


class PromptBuilder:
    """Fits documents and a question into the target's window (see the module docstring).

    ``long_budget``: most document tokens the target reads of documents longer than its window (0: as many
    as fit); ``lead_tokens`` of them are always the documents' beginning, the same for every question.
    """

    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        max_context: int,
        cache_items: int = 16,
        long_budget: int = 0,
        lead_tokens: int = 0,
        chat_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.chat_options = dict(chat_options or {})
        # a prefix's KV depends on the template's options too (a template may read them anywhere): in every key
        self._key_name = model_name + (json.dumps(self.chat_options, sort_keys=True) if self.chat_options else "")
        self.model_name = model_name
        self.max_context = max_context
        self.long_budget = long_budget
        self.lead_tokens = lead_tokens
        self._lock = threading.Lock()
        self._prefixes: OrderedDict[str, array[int]] = OrderedDict()  # prefix key -> prefix ids
        self._cache_items = cache_items
        self._channels: tuple[str | None, Harmony | None] | None = None  # (the template it was found for, it)

    def key_for(self, system: str, doc_ids: Sequence[str]) -> str:
        """The prefix key of ``system`` over ``doc_ids`` for this model and its template's options."""
        return prefix_key(self._key_name, system, doc_ids)

    @property
    def stops(self) -> tuple[str, ...]:
        """Stop strings every answer gets from the prompt layout (a plain prompt's next ``Question:``)."""
        return turn_stops(self.tokenizer)

    @property
    def channels(self) -> Harmony | None:
        """The harmony markup where the chat template is harmony (gpt-oss: the answer is the final channel of what
        the model writes, ``decoding.speculative.channels``), else None; found once per template."""
        with self._lock:
            template = getattr(self.tokenizer, "chat_template", None)
            if self._channels is None or self._channels[0] != template:
                self._channels = (template, harmony_of(self.tokenizer, self.chat_options))
            return self._channels[1]

    def _build(
        self,
        system: str,
        document: str | Sequence[str],
        question: str,
        history: Sequence[tuple[str, str]],
        key: str | None,
    ) -> Prompt:
        with self._lock:
            return build_prompt(
                self.tokenizer,
                system=system,
                document=document,
                question=question,
                history=history,
                prefix_key=key,
                chat_options=self.chat_options,
            )

    def _prompt(
        self,
        system: str,
        docs: Sequence[DocumentText],
        question: str,
        history: Sequence[tuple[str, str]],
        key: str,
    ) -> Prompt:
        """Like ``build_prompt`` over ``docs``; the prefix ids of a known key come from the cache.

        The suffix never depends on the document (the template pieces are tokenized separately), so it is
        built over an empty document and joined to the cached prefix; the documents are not even read.
        """
        with self._lock:
            cached = self._prefixes.get(key)
            if cached is not None:
                self._prefixes.move_to_end(key)
        if cached is None:
            prompt = self._build(system, join_documents(docs), question, history, key)
            with self._lock:
                self._prefixes[key] = array("i", prompt.prefix_ids)
                while len(self._prefixes) > self._cache_items:
                    self._prefixes.popitem(last=False)
            return prompt
        rest = self._build(system, "", question, history, key)
        return Prompt(prefix_ids=cached, suffix_ids=rest.suffix_ids, prefix_key=key)

    def _trim_history(
        self, system: str, question: str, history: list[tuple[str, str]], room: int
    ) -> tuple[list[tuple[str, str]], Prompt]:
        """The most recent turns whose prompt (without documents) fits ``room``, and that prompt.

        Dropping turns only shortens the prompt, so the number to drop is found by bisection: a few prompt
        builds, not one per dropped turn (each build holds the tokenizer lock that every request shares)."""
        built: dict[int, Prompt] = {}

        def fits(k: int) -> bool:
            built[k] = self._build(system, "", question, history[k:], None)
            return len(built[k].ids) <= room

        if fits(0) or not history:
            return history, built[0]
        k = _first_fitting(1, len(history), fits)
        return history[k:], built[k] if k in built else self._build(system, "", question, history[k:], None)

    def draft_prompt(
        self, context: str, question: str, history: Sequence[tuple[str, str]], system: str = SYSTEM_PROMPT
    ) -> list[int]:
        """The RAG drafter's prompt ids: the target's layout and template with ``context`` (the retrieved
        chunks) as the document, the same question and history."""
        return self._build(system, context, question, history, None).ids

    def draft_rows(
        self, prompt: Prompt, docs: Sequence[DocumentText], hits: Sequence[Hit]
    ) -> list[tuple[int, int]]:
        """The rows of ``prompt`` (over the whole ``docs``) that RAPID's KV drafter reads: the system part, the
        tokens of ``hits`` (retrieved chunks) and the question part."""
        spans, offset = [], 0
        starts: dict[str, int] = {}
        for d in docs:
            if len(docs) > 1:
                offset += len(f"Document: {d.title}\n\n")
            starts[d.id] = offset
            offset += len(d.text) + len(DOCUMENT_SEPARATOR)
        for h in hits:
            if h.document_id in starts:
                spans.append((starts[h.document_id] + h.start, starts[h.document_id] + h.end))
        with self._lock:
            return context_rows(self.tokenizer, prompt, join_documents(docs), spans)

    def warm_prompt(
        self,
        docs: Sequence[DocumentText],
        max_tokens: int,
        retriever: Retriever | None = None,
        tenant: str | None = None,
        system: str = SYSTEM_PROMPT,
    ) -> Prompt | None:
        """The prompt whose prefix a first question over ``docs`` will reuse: the whole documents, or for
        documents longer than the window their lead (``lead_tokens``); None if there is nothing to reuse."""
        key = self.key_for(system, [d.id for d in docs])
        if sum(d.n_tokens for d in docs) + max_tokens + 64 <= self.max_context:
            prompt = self._prompt(system, docs, "", (), key)
            if len(prompt.prefix_ids) + max_tokens + 64 <= self.max_context:
                return prompt
        lead = min(self.lead_tokens, self._long_budget(self.max_context - max_tokens - 64))
        if retriever is None or lead <= 0:
            return None
        selection = retriever.rank([""], [d.id for d in docs], tenant=tenant).window(lead, lead_tokens=lead)
        return self._build(system, hit_pieces(selection.hits), "", (), key) if selection.hits else None

    def _long_budget(self, room: int) -> int:
        return min(room, self.long_budget) if self.long_budget > 0 else room

    def fit(
        self,
        docs: Sequence[DocumentText],
        question: str,
        history: Sequence[tuple[str, str]],
        max_tokens: int,
        ranking: Ranking | None,
        system: str = SYSTEM_PROMPT,
    ) -> Prompt:
        """The target's prompt over ``docs``, cut to the most relevant chunks of ``ranking`` (the request's
        retrieval over ``docs``) when it is too long.

        Older history turns are dropped first when even an empty document does not fit. Raises
        ``ContextTooLong`` when the question alone does not fit.
        """
        room = self.max_context - max_tokens
        history, bare = self._question_part(system, question, history, max_tokens)
        if not docs:
            return bare
        budget = room - len(bare.ids)
        # Far too long by the indexing token count: skip tokenizing the whole text, go to the chunks.
        if sum(d.n_tokens for d in docs) <= budget + LENGTH_SLACK:
            key = self.key_for(system, [d.id for d in docs])
            prompt = self._prompt(system, docs, question, history, key)
            if len(prompt.ids) <= room:
                return prompt
        if ranking is None:
            raise ContextTooLong(f"the documents do not fit the {room} tokens left in the window")
        key = self.key_for(system, [d.id for d in docs])
        return self._fit_chunks(ranking, key, system, question, history, room, budget, self.lead_tokens, None)

    def fit_chunks(
        self,
        ranking: Ranking,
        key_parts: Sequence[str],
        question: str,
        history: Sequence[tuple[str, str]],
        max_tokens: int,
        titles: Mapping[str, str],
        system: str = SYSTEM_PROMPT,
    ) -> Prompt:
        """A question over collections too large for the window: the best chunks of ``ranking`` that fit, in
        document order, each document's first chunk after its title (so that an answer can say where a fact comes
        from); ``key_parts`` name the prefix (the collections at their versions). Marked ``context_truncated``."""
        room = self.max_context - max_tokens
        history, bare = self._question_part(system, question, history, max_tokens)
        key = self.key_for(system, key_parts)
        return self._fit_chunks(ranking, key, system, question, history, room, room - len(bare.ids), 0, titles)

    def _question_part(
        self, system: str, question: str, history: Sequence[tuple[str, str]], max_tokens: int
    ) -> tuple[list[tuple[str, str]], Prompt]:
        """The history that fits with the question (older turns dropped first) and the prompt without documents;
        ``ContextTooLong`` when the question alone does not fit."""
        room = self.max_context - max_tokens
        kept, bare = self._trim_history(system, question, list(history), room)
        if len(bare.ids) > room:
            raise ContextTooLong(
                f"the question needs {len(bare.ids)} prompt tokens and {max_tokens} new tokens, more than "
                f"the target's {self.max_context}-token window; shorten the question or lower max_tokens"
            )
        return kept, bare

    def _fit_chunks(
        self, ranking: Ranking, key: str, system: str, question: str, history: Sequence[tuple[str, str]],
        room: int, budget: int, lead_tokens: int, titles: Mapping[str, str] | None,
    ) -> Prompt:
        """The most relevant chunks in document order, after the documents' lead; each chunk a cacheable segment
        (its KV is reused by any later prompt over these documents that starts with the same chunks)."""
        budget = self._long_budget(budget)
        for _ in range(FIT_ATTEMPTS):
            if budget <= 0:
                break
            selection = ranking.window(budget, lead_tokens=lead_tokens)
            cut = self._build(system, hit_pieces(selection.hits, titles), question, history, key)
            if len(cut.ids) <= room:
                logger.info("documents cut to %d tokens to fit the window", len(cut.prefix_ids))
                return replace(cut, context_truncated=True)
            budget -= len(cut.ids) - room + 16  # chunks tokenized apart count differently: tighten and retry
        raise ContextTooLong("could not fit any part of the documents into the target's window")


def _first_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The smallest k in [lo, hi] with ``fits(k)``, for a ``fits`` that stays true once true (hi if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def document_texts(store: DocumentStore, records: Sequence[DocumentRecord]) -> list[DocumentText]:
    return [
        DocumentText(r.id, r.title, r.n_tokens, partial(store.load_text, r.id)) for r in records
    ]
