"""RACER's draft paths as pure functions: the logits BFS breadth rule, shared paths."""

from __future__ import annotations

import random

import numpy as np
import pytest

from decoding.drafters.racer.logits_table import EMPTY, LogitsTable
from decoding.drafters.racer.paths import (
    SOURCE_CROSS_SESSION,
    SOURCE_LOGITS,
    logits_paths,
    shared_paths,
)
from decoding.speculative.tree import ROOT, DraftTree, merge_trees


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]


def assert_well_formed(tree: DraftTree) -> None:
    seen = set()
    for i, p in enumerate(tree.parents):
        assert p == ROOT or 0 <= p < i  # parents first
        assert (p, tree.tokens[i]) not in seen  # no duplicate siblings
        seen.add((p, tree.tokens[i]))


def make_table(vocab: int = 1000, k: int = 8) -> LogitsTable:
    table = LogitsTable(vocab, k)
    ids = np.arange(vocab)
    rows = (ids[:, None] * k + np.arange(1, k + 1)[None, :]) % vocab  # row x: 8 distinct tokens
    table.update(ids, rows)
    return table


def test_logits_bfs_breadth_rule() -> None:
    table = make_table()
    root = 3
    # root breadth 8 -> 8 children with breadths 4,2,1,1,1,1,1,1 -> 4+2+6 = 12 grandchildren
    tree = logits_paths(table, root, budget=20, breadth=8)
    assert_well_formed(tree)
    kids = tree.children()
    first = kids[0]
    assert [tree.tokens[i] for i in first] == table.next_tokens(root, 8)
    assert [len(kids[i + 1]) for i in first] == [4, 2, 1, 1, 1, 1, 1, 1]
    for i in first:
        assert [tree.tokens[c] for c in kids[i + 1]] == table.next_tokens(tree.tokens[i], len(kids[i + 1]))
    assert set(tree.sources) == {SOURCE_LOGITS}
    # the next node in BFS order: the first grandchild (breadth 4 >> 1 = 2) gets its first child
    more = logits_paths(table, root, budget=21, breadth=8)
    grand = kids[first[0] + 1][0]
    assert more.parents[20] == grand and more.tokens[20] == table.next_tokens(tree.tokens[grand], 1)[0]
    # breadth of the second grandchild of c0 is max(1, 4 >> 2) = 1, of c1's first child max(1, 2 >> 1) = 1
    deep = logits_paths(table, root, budget=200, breadth=8)
    dk = deep.children()
    c0, c1 = dk[0][0], dk[0][1]
    assert [len(dk[g + 1]) for g in dk[c0 + 1]] == [2, 1, 1, 1]
    assert [len(dk[g + 1]) for g in dk[c1 + 1]] == [1, 1]
    assert len(deep) == 200


@pytest.mark.parametrize("seed", range(8))
def test_logits_paths_into_a_tree_equal_merging_after_it(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 12  # small: many logits paths coincide with the given tree
    table = LogitsTable(vocab, 4)
    table.update(list(range(vocab)), np.array([rng.sample(range(vocab), 4) for _ in range(vocab)]))
    head = DraftTree()
    for _ in range(rng.randrange(0, 8)):
        parent = rng.randrange(-1, len(head))
        if (parent, tok := rng.randrange(vocab)) not in set(zip(head.parents, head.tokens, strict=True)):
            head.add(parent, tok, "racer.retrieval")
    budget = rng.randrange(len(head), 30)
    filled = logits_paths(table, 3, budget, breadth=4, into=head)
    expected = merge_trees([head, logits_paths(table, 3, budget + len(head), breadth=4)], budget)
    assert (filled.tokens, filled.parents, filled.sources) == (expected.tokens, expected.parents,
                                                               expected.sources)
    assert len(filled) == budget or len(logits_paths(table, 3, 10_000, breadth=4)) < 10_000
    assert_well_formed(filled)


def test_logits_paths_skip_unknown_rows_and_empty_entries() -> None:
    table = LogitsTable(50, 4)
    table.update([7], np.array([[9, 11, -1, -1]]))
    tree = logits_paths(table, 7, budget=10, breadth=4)
    assert paths(tree) == [(9,), (11,)]  # 9 and 11 have no rows: the BFS stops
    assert len(logits_paths(table, 8, budget=10)) == 0


def test_shared_paths_weigh_continuations_through_a_node() -> None:
    conts = [((5, 1, 2, 3), 3.0), ((5, 1, 4), 1.0), ((6, 9, 9), 5.0), ((5,), 9.0)]
    tree = shared_paths(conts, root=5, budget=10)
    assert paths(tree) == [(1,), (1, 2), (1, 2, 3), (1, 4)]
    assert set(tree.sources) == {SOURCE_CROSS_SESSION}
    assert paths(shared_paths(conts, root=5, budget=2)) == [(1,), (1, 2)]
    assert len(shared_paths(conts, root=7, budget=5)) == 0


def test_empty_entries_never_become_nodes() -> None:
    table = LogitsTable(20, 3)
    table.update([1], np.array([[2, 25, EMPTY]]))  # 25 is out of vocabulary: dropped
    assert table.next_tokens(1, 3) == [2]
