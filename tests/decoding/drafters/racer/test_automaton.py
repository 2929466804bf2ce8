"""The per-request n-gram automaton on literal token lists, against a brute-force oracle."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.drafters.racer.automaton import NONE, ROOT, NgramAutomaton
from tests.decoding.drafters.racer.conftest import (
    LruOracle,
    check_invariants,
    held,
    longest_held_suffix,
    oracle_counts,
    strings,
)


def test_counts_links_and_state_on_a_literal_text() -> None:
    text = [1, 2, 3, 1, 2, 4]
    auto = NgramAutomaton(max_ngram=3, max_nodes=1000)
    auto.extend(text)
    assert strings(auto) == oracle_counts(text, 3)
    assert auto.count(auto.lookup([1, 2])) == 2
    assert auto.count(auto.lookup([2])) == 2
    assert auto.count(auto.lookup([1, 2, 3])) == 1
    assert auto.lookup([1, 2, 3, 1]) == NONE  # longer than the window
    assert auto.string(auto.link(auto.lookup([1, 2, 4]))) == (2, 4)
    assert auto.string(auto.state) == (2, 4)  # longest suffix of length <= max_ngram - 1
    assert auto.position == 6
    check_invariants(auto, text, exact=True)


def test_continuations_are_ranked_by_count() -> None:
    auto = NgramAutomaton(max_ngram=4, max_nodes=1000)
    auto.extend([7, 8, 1, 7, 8, 2, 7, 8, 1, 7, 8, 3, 7, 8, 1])
    ranked = auto.continuations(auto.lookup([7, 8]))
    assert [(tok, cnt) for tok, cnt, _ in ranked] == [(1, 3), (3, 1), (2, 1)]  # ties: most recent first


def test_matching_follows_failure_links() -> None:
    auto = NgramAutomaton(max_ngram=4, max_nodes=1000)
    auto.extend([5, 6, 7, 9, 6, 7, 8])
    state = auto.match([1, 5, 6, 7])
    assert auto.string(state) == (5, 6, 7)
    state = auto.advance(state, 8)  # (5,6,7,8) never occurred: fall back to (6,7,8)
    assert auto.string(state) == (6, 7, 8)
    state = auto.advance(state, 3)  # token never seen: root
    assert state == ROOT
    assert auto.string(auto.match([9, 6, 7, 8])) == (6, 7, 8)  # depth capped at max_ngram - 1


def test_output_tokens_update_links_incrementally() -> None:
    """Links stay right for text fed after a bulk-built prompt (the reference code's defect)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    auto = NgramAutomaton.build(prompt, max_ngram=5, max_nodes=10_000)
    check_invariants(auto, prompt, exact=True)
    text = list(prompt)
    for tok in [8, 9, 7, 9, 3, 1, 4, 1, 5]:
        auto.feed(tok)
        text.append(tok)
        check_invariants(auto, text, exact=True)


def test_eviction_is_leaf_only_and_respects_the_bound() -> None:
    auto = NgramAutomaton(max_ngram=4, max_nodes=40)
    text: list[int] = []
    for i in range(300):
        tok = (i * 7 + i // 5) % 11
        auto.feed(tok)
        text.append(tok)
        assert len(auto) <= 40
    assert auto.evicted > 0
    check_invariants(auto, text, exact=False)  # no orphans, no dangling links, counts bounded, stamps right


def test_eviction_drops_least_recently_touched_leaves_first() -> None:
    old = list(range(1, 9))  # 21 nodes + root
    auto = NgramAutomaton(max_ngram=3, max_nodes=25)
    auto.extend(old)
    assert auto.evicted == 0
    recent = [9, 8, 9, 8, 9, 8]
    auto.extend(recent * 3)
    # the recent text's windows survive, the old deepest windows went first
    for s in ([9, 8, 9], [8, 9, 8], [9, 8]):
        assert auto.lookup(s) != NONE
    assert auto.evicted > 0
    assert auto.lookup([1, 2, 3]) == NONE
    check_invariants(auto, old + recent * 3, exact=False)


def test_counts_restart_for_a_node_that_was_evicted() -> None:
    auto = NgramAutomaton(max_ngram=2, max_nodes=8)
    text = [1, 2, 3, 4, 5, 6, 1, 2]
    auto.extend(text)
    check_invariants(auto, text, exact=False)
    assert auto.count(auto.lookup([1, 2])) == 1  # (1,2) was evicted and re-created: counted since then


def test_build_equals_feeding_and_copies_are_independent() -> None:
    text = [4, 4, 2, 4, 4, 2, 1, 4, 4]
    built = NgramAutomaton.build(text, max_ngram=4, max_nodes=1000)
    fed = NgramAutomaton(max_ngram=4, max_nodes=1000)
    fed.extend(text)
    assert strings(built) == strings(fed)
    assert built.string(built.state) == fed.string(fed.state)
    copy = built.copy()
    copy.extend([7, 7])
    assert built.lookup([7]) == NONE and copy.lookup([7, 7]) != NONE
    check_invariants(built, text, exact=True)
    check_invariants(copy, [*text, 7, 7], exact=True)


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        NgramAutomaton(max_ngram=1)
    with pytest.raises(ValueError):
        NgramAutomaton(max_ngram=10, max_nodes=20)
    auto = NgramAutomaton(max_ngram=3, max_nodes=100)
    with pytest.raises(ValueError):
        auto.feed(-1)
    with pytest.raises(ValueError):
        NgramAutomaton.build([1, -2, 3], max_ngram=3)
    assert len(NgramAutomaton.build([], max_ngram=3)) == 1


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.lists(st.integers(0, 4), max_size=70),
    max_ngram=st.integers(2, 5),
    split=st.integers(0, 70),
    small_bound=st.booleans(),
    extra=st.integers(0, 40),
    query=st.lists(st.integers(0, 5), max_size=12),
)
def test_automaton_matches_the_oracle(
    text: list[int], max_ngram: int, split: int, small_bound: bool, extra: int, query: list[int]
) -> None:
    floor = max_ngram * (max_ngram + 1) // 2 + 2
    bound = floor + extra if small_bound else 100_000
    split = min(split, len(text))
    auto = NgramAutomaton.build(text[:split], max_ngram=max_ngram, max_nodes=bound)
    for tok in text[split:]:
        auto.feed(tok)
        assert len(auto) <= bound
    exact = len(oracle_counts(text, max_ngram)) + 1 <= bound and auto.evicted == 0
    check_invariants(auto, text, exact=exact)
    if not small_bound:
        assert exact
    # Aho–Corasick matching of any query: the longest held suffix of depth <= max_ngram - 1
    state = ROOT
    for i, tok in enumerate(query):
        state = auto.advance(state, tok)
        assert auto.string(state) == longest_held_suffix(auto, query[: i + 1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.lists(st.integers(0, 3), max_size=60),
    max_ngram=st.integers(2, 4),
    extra=st.integers(0, 25),
)
def test_eviction_is_exact_lru_over_leaves(text: list[int], max_ngram: int, extra: int) -> None:
    """Token by token, the automaton holds exactly what the brute-force LRU model holds (counts too)."""
    bound = max_ngram * (max_ngram + 1) // 2 + 2 + extra
    auto = NgramAutomaton(max_ngram=max_ngram, max_nodes=bound)
    oracle = LruOracle(max_ngram, bound)
    for tok in text:
        auto.feed(tok)
        oracle.feed(tok)
        assert held(auto) == oracle.state()
