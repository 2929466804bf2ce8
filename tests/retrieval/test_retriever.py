from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from retrieval.embedding import Embedder
from retrieval.errors import DocumentNotFound, DocumentNotReady
from retrieval.lexical import bm25_scores
from retrieval.retriever import (
    BGE_M3_THRESHOLD,
    DEFAULT_LEXICAL_WEIGHT,
    MINILM_THRESHOLD,
    Hit,
    Retriever,
    default_budget,
    default_threshold,
    hit_pieces,
    join_hits,
    pack_hits,
)
from retrieval.store import DocumentStore
from tests.conftest import CountingEmbedder

ANIMALS = "\n\n".join([
    "Cats are small domesticated carnivores. They sleep for most of the day and hunt mice at night.",
    "Dogs were domesticated from wolves thousands of years ago. They are loyal and love to fetch sticks.",
    "Parrots can imitate human speech. Some parrots live for more than eighty years in captivity.",
    "Goldfish are kept in bowls and ponds. Their memory is much better than the popular myth says.",
])
SPACE = "\n\n".join([
    "The Moon orbits the Earth every twenty-seven days. Its gravity causes the ocean tides.",
    "Mars is called the red planet because of iron oxide dust on its surface.",
    "Jupiter is the largest planet of the solar system; its great red spot is a giant storm.",
])


def hit(doc: str, start: int, n_tokens: int, score: float) -> Hit:
    return Hit(document_id=doc, chunk_id=start, text=f"<{doc}:{start}>", score=score, start=start,
               end=start + 10, page=None, n_tokens=n_tokens)


def test_default_budget_and_threshold() -> None:
    assert default_budget(1_000, 8192) == 4096  # floor
    assert default_budget(120_000, 16_384) == 5_000  # L / 24
    assert default_budget(400_000, 8192) == 8192  # cap
    assert default_budget(10, 2048) == 2048  # a cap below the floor wins
    assert default_threshold("bge-m3 (bge-m3, dense)") == BGE_M3_THRESHOLD == 0.3
    assert default_threshold("all-MiniLM-L6-v2 (flag, mean pooling)") == MINILM_THRESHOLD


def test_pack_hits_by_score_into_budget_then_document_order() -> None:
    hits = [hit("b", 0, 50, 0.9), hit("a", 30, 60, 0.8), hit("a", 10, 30, 0.7), hit("b", 90, 20, 0.2)]
    kept = pack_hits(hits, budget_tokens=100, doc_order=["a", "b"])
    # 0.9 (50) fits, 0.8 (60) does not, 0.7 (30) fits, 0.2 (20) fits: 100 tokens
    assert [(h.document_id, h.start) for h in kept] == [("a", 10), ("b", 0), ("b", 90)]
    assert pack_hits(hits, budget_tokens=10) == []
    adjacent = [hit("a", 0, 1, 1.0), hit("a", 10, 1, 1.0), hit("b", 0, 1, 1.0)]
    assert join_hits(adjacent) == "<a:0><a:10>\n\n<b:0>"
    assert hit_pieces(adjacent) == ["<a:0>", "<a:10>", "\n\n<b:0>"]


def test_pack_hits_keeps_a_lead_in_document_order_then_fills_by_score() -> None:
    hits = [hit("b", 0, 50, 0.9), hit("a", 30, 60, 0.8), hit("a", 10, 30, 0.1), hit("a", 0, 20, 0.0),
            hit("b", 90, 20, 0.2)]
    # the lead: a:0 (20) and a:10 (30) fit 60 tokens, a:30 would not; then by score: b:0 (50) fits 100
    kept = pack_hits(hits, budget_tokens=100, doc_order=["a", "b"], lead_tokens=60)
    assert [(h.document_id, h.start) for h in kept] == [("a", 0), ("a", 10), ("b", 0)]
    assert pack_hits(hits, budget_tokens=30, doc_order=["a", "b"], lead_tokens=60) == [hits[3]]  # budget wins
    assert pack_hits(hits, 100, ["a", "b"], lead_tokens=0) == pack_hits(hits, 100, ["a", "b"])


@pytest.fixture(scope="module")
def indexed(tmp_path_factory: pytest.TempPathFactory, target_tokenizer: Any, minilm: Embedder) -> Any:
    store = DocumentStore(tmp_path_factory.mktemp("store"))
    animals = store.create("zoo", "Animals", "animals.txt", None, ANIMALS.encode())
    space = store.create("zoo", "Space", "space.md", None, SPACE.encode())
    for record in (animals, space):
        store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=24)
    return store, animals.id, space.id


def test_retrieve_scores_threshold_budget_and_order(indexed: Any, minilm: Embedder) -> None:
    store, animals, space = indexed
    retriever = Retriever(store, minilm)
    result = retriever.retrieve("How long do parrots live?", [space, animals], top_k=4, threshold=0.0)
    assert 0 < len(result.hits) <= 4
    assert result.budget_tokens == default_budget(store.get(animals).n_tokens + store.get(space).n_tokens)
    assert result.used_tokens == sum(h.n_tokens for h in result.hits) <= result.budget_tokens
    best = max(result.hits, key=lambda h: h.score)
    assert best.document_id == animals and "eighty years" in best.text
    # document order: doc_ids order (space first), then position
    keys = [([space, animals].index(h.document_id), h.start) for h in result.hits]
    assert keys == sorted(keys)
    for h in result.hits:
        chunk = store.load_chunks(h.document_id)[h.chunk_id]
        assert (h.text, h.start, h.end, h.n_tokens) == (chunk.text, chunk.start, chunk.end, chunk.n_tokens)
        assert store.load_text(h.document_id)[h.start : h.end] == h.text
    assert result.context_text.count(best.text) == 1


def test_threshold_drops_weak_hits(indexed: Any, minilm: Embedder) -> None:
    store, animals, space = indexed
    retriever = Retriever(store, minilm)
    everything = retriever.retrieve("red planet iron oxide", [animals, space], top_k=50, threshold=-1.0)
    assert len(everything.hits) == store.get(animals).n_chunks + store.get(space).n_chunks
    cut = 0.3
    kept = retriever.retrieve("red planet iron oxide", [animals, space], top_k=50, threshold=cut)
    assert kept.hits and all(h.similarity is not None and h.similarity >= cut for h in kept.hits)
    assert len(kept.hits) == sum(h.similarity is not None and h.similarity >= cut for h in everything.hits)
    assert {h.document_id for h in kept.hits} == {space}
    nothing = retriever.retrieve("red planet iron oxide", [animals, space], threshold=0.999)
    assert (nothing.hits, nothing.context_text, nothing.used_tokens) == ([], "", 0)


def test_budget_limits_hits(indexed: Any, minilm: Embedder) -> None:
    store, animals, _ = indexed
    retriever = Retriever(store, minilm, threshold=-1.0)
    sizes = [c.n_tokens for c in store.load_chunks(animals)]
    budget = max(sizes) + 1
    result = retriever.retrieve("dogs and wolves", [animals], top_k=50, budget_tokens=budget)
    assert result.budget_tokens == budget and 0 < result.used_tokens <= budget
    assert "wolves" in result.hits[0].text or any("wolves" in h.text for h in result.hits)


def test_window_fills_the_budget_without_threshold(indexed: Any, minilm: Embedder) -> None:
    store, animals, space = indexed
    retriever = Retriever(store, minilm, threshold=0.99)  # the threshold does not apply here
    chunks = store.load_chunks(animals) + store.load_chunks(space)
    budget = sum(c.n_tokens for c in chunks) // 2
    ranking = retriever.rank(["goldfish memory"], [animals, space])
    result = ranking.window(budget)
    assert result.hits and result.used_tokens <= budget
    assert any("Goldfish" in h.text for h in result.hits)
    keys = [([animals, space].index(h.document_id), h.start) for h in result.hits]
    assert keys == sorted(keys)
    full = ranking.window(10**6)
    kept = {(h.document_id, h.chunk_id) for h in result.hits}
    for h in full.hits:  # a chunk is left out only when it no longer fit after the better ones
        if (h.document_id, h.chunk_id) not in kept:
            better = sum(k.n_tokens for k in result.hits if k.score > h.score)
            assert better + h.n_tokens > budget
    assert len(full.hits) == len(chunks)


def test_one_ranking_feeds_every_cut_with_one_embedder_call(indexed: Any, minilm: Embedder) -> None:
    """``rank`` embeds once for every query; ``relevant`` is what ``retrieve`` returns and ``window`` cuts the
    same scores again: no cut asks the embedder."""
    store, animals, space = indexed
    counting = CountingEmbedder(minilm)
    retriever = Retriever(store, counting, threshold=0.2)  # type: ignore[arg-type]
    ranking = retriever.rank(["How long do parrots live?"], [animals, space])
    assert len(counting.calls) == 1
    relevant, window = ranking.relevant(), ranking.window(40, lead_tokens=10)
    assert ranking.relevant(30).used_tokens <= 30 and window.used_tokens <= 40
    assert len(counting.calls) == 1
    assert relevant == Retriever(store, minilm, threshold=0.2).retrieve("How long do parrots live?", [animals, space])
    assert {h.chunk_id for h in relevant.hits} <= {h.chunk_id for h in ranking.hits}


def test_two_queries_rank_each_chunk_by_its_better_score(indexed: Any, minilm: Embedder) -> None:
    """A follow-up's ranking (question + question after the conversation): both embedded in one call, each chunk
    with the better of its two scores (and that query's similarity)."""
    store, animals, space = indexed
    counting = CountingEmbedder(minilm)
    retriever = Retriever(store, counting)  # type: ignore[arg-type]
    queries = ["And how long do they live?", "Tell me about parrots. And how long do they live?"]
    both = retriever.rank(queries, [animals, space])
    assert counting.calls == [queries]
    alone = [{(h.document_id, h.chunk_id): h for h in retriever.rank([q], [animals, space]).hits} for q in queries]
    for h in both.hits:
        first, second = alone[0][h.document_id, h.chunk_id], alone[1][h.document_id, h.chunk_id]
        best = second if second.score > first.score else first
        assert h.score == pytest.approx(best.score, abs=1e-5)
        assert h.similarity == pytest.approx(best.similarity, abs=1e-5)
    parrots = next(h for h in both.hits if "eighty years" in h.text)
    assert parrots.score > alone[0][parrots.document_id, parrots.chunk_id].score  # the second query found it
    assert retriever.rank([queries[0], queries[0]], [animals]).hits == retriever.rank([queries[0]], [animals]).hits
    with pytest.raises(ValueError, match="at least one query"):
        retriever.rank([], [animals])


def test_errors_and_cache_invalidation(indexed: Any, minilm: Embedder, target_tokenizer: Any) -> None:
    store, animals, _ = indexed
    retriever = Retriever(store, minilm)
    with pytest.raises(DocumentNotFound):
        retriever.retrieve("q", [animals], tenant="someone-else")
    with pytest.raises(DocumentNotFound):
        retriever.retrieve("q", ["0" * 32])
    with pytest.raises(ValueError, match="repeat"):
        retriever.retrieve("q", [animals, animals])
    queued = store.create("zoo", "later", "later.txt", None, b"Not indexed yet.")
    with pytest.raises(DocumentNotReady):
        retriever.retrieve("q", [queued.id])
    first = retriever.retrieve("cats", [animals], threshold=-1.0, top_k=50)
    store.ingest(animals, target_tokenizer, minilm, chunk_tokens=200)  # re-index: fewer, larger chunks
    again = retriever.retrieve("cats", [animals], threshold=-1.0, top_k=50)
    assert len(again.hits) == store.get(animals).n_chunks < len(first.hits)
    store.ingest(animals, target_tokenizer, minilm, chunk_tokens=24)


RULES = "\n\n".join([
    "Verbosity: the tool prints more details about its work when it is asked to be chatty.",
    "Set FROBNICATE_LEVEL to an integer between 0 and 9 in the environment.",
    "Colours in the output can be switched off for terminals that do not support them.",
])


def test_hybrid_score_is_the_weighted_sum_of_similarity_and_bm25_over_the_documents_asked(
    indexed: Any, minilm: Embedder, target_tokenizer: Any
) -> None:
    store, animals, space = indexed
    rules = store.create("zoo", "Rules", "rules.txt", None, RULES.encode())
    store.ingest(rules.id, target_tokenizer, minilm, chunk_tokens=24)
    doc_ids = [animals, space, rules.id]
    question = "What values does frobnicate_level take?"
    dense = {(h.document_id, h.chunk_id): h for h in Retriever(store, minilm, scoring="dense").score(question, doc_ids)}
    lexical = [store.load_lexical(d) for d in doc_ids]
    bm25 = dict(zip([(d, c) for d, ix in zip(doc_ids, lexical, strict=True) for c in range(ix.n_chunks)],
                    np.concatenate(bm25_scores(question, lexical)), strict=True))
    hybrid = Retriever(store, minilm, lexical_weight=0.4).score(question, doc_ids)
    assert {(h.document_id, h.chunk_id) for h in hybrid} == set(dense) == set(bm25)
    for h in hybrid:
        key = (h.document_id, h.chunk_id)
        assert h.similarity == dense[key].score == dense[key].similarity
        assert h.score == pytest.approx(0.6 * h.similarity + 0.4 * bm25[key], abs=1e-6)
    assert max(bm25, key=bm25.get)[0] == rules.id and "FROBNICATE_LEVEL" in store.load_chunks(rules.id)[
        max(bm25, key=bm25.get)[1]].text
    only_lexical = Retriever(store, minilm, lexical_weight=1.0, threshold=-1.0).retrieve(question, doc_ids, top_k=1)
    assert "FROBNICATE_LEVEL" in only_lexical.hits[0].text
    store.delete(rules.id)


def test_scoring_settings_are_checked(indexed: Any, minilm: Embedder) -> None:
    store, _, _ = indexed
    with pytest.raises(ValueError, match="lexical_weight"):
        Retriever(store, minilm, lexical_weight=1.5)
    with pytest.raises(ValueError, match="scoring"):
        Retriever(store, minilm, scoring="sparse")  # type: ignore[arg-type]
    assert Retriever(store, minilm, scoring="dense", lexical_weight=0.5).lexical_weight == 0.0
    assert Retriever(store, minilm).lexical_weight == DEFAULT_LEXICAL_WEIGHT


def test_empty_result_for_unrelated_query_with_calibrated_threshold(indexed: Any, minilm: Embedder) -> None:
    store, animals, space = indexed
    retriever = Retriever(store, minilm)  # default (calibrated) MiniLM threshold
    assert retriever.threshold == MINILM_THRESHOLD
    off_topic = retriever.retrieve("quarterly tax filing deadline for corporations", [animals, space])
    on_topic = retriever.retrieve("Which planet has a giant storm?", [animals, space])
    assert len(off_topic.hits) < len(on_topic.hits)
    assert any("Jupiter" in h.text for h in on_topic.hits)



def test_document_cache_is_bounded_by_bytes_least_recently_asked_dropped_first(
    indexed: Any, minilm: Embedder
) -> None:
    store, animals, space = indexed
    retriever = Retriever(store, minilm)
    retriever.rank(["cats"], [animals, space])
    sizes = {d: retriever._cache[d].nbytes for d in (animals, space)}
    windows = len(retriever._cache[animals].index)
    assert sizes[animals] >= windows * minilm.dim * 4  # at least its window vectors
    assert retriever._cached_bytes == sum(sizes.values())
    small = Retriever(store, minilm, cache_bytes=max(sizes.values()))  # room for one of the two
    small.rank(["cats"], [animals, space])
    assert list(small._cache) == [space] and small._cached_bytes == sizes[space]
    first = small.rank(["moon"], [animals])  # the one asked is cached, the other dropped
    assert list(small._cache) == [animals]
    assert small.rank(["moon"], [animals]).hits == first.hits
    small.invalidate(animals)
    assert not small._cache and small._cached_bytes == 0
    nothing = Retriever(store, minilm, cache_bytes=0)  # still keeps the last one (asked twice in a row is common)
    nothing.rank(["cats"], [animals, space])
    assert list(nothing._cache) == [space]
