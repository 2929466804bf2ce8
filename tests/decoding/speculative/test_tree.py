"""Draft trees on literal inputs: depths, merging with de-duplication and budget, layout and masks."""

from __future__ import annotations

import torch

from decoding.speculative.tree import ROOT, DraftTree, merge_trees, tree_layout


def test_chain_depths_paths_children() -> None:
    t = DraftTree.chain([10, 11, 12], "a")
    assert t.parents == [ROOT, 0, 1]
    assert t.depths() == [1, 2, 3]
    assert t.path_to(2) == [0, 1, 2]
    assert t.children() == [[0], [1], [2], []]


def test_add_rejects_bad_parent() -> None:
    t = DraftTree()
    try:
        t.add(3, 1, "a")
    except ValueError as e:
        assert "out of range" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_merge_deduplicates_and_counts_unique_nodes() -> None:
    a = DraftTree.chain([1, 2, 3], "retrieval")
    b = DraftTree.chain([1, 2, 4, 5], "logits")  # shares the path 1, 2
    merged = merge_trees([a, b], budget=5)
    assert merged.tokens == [1, 2, 3, 4, 5]
    assert merged.parents == [ROOT, 0, 1, 1, 3]
    assert merged.sources == ["retrieval", "retrieval", "retrieval", "logits", "logits"]
    # budget counted after de-duplication: shared nodes cost nothing
    assert len(merge_trees([a, b], budget=4)) == 4
    assert merge_trees([a, b], budget=4).tokens == [1, 2, 3, 4]


def test_merge_drops_children_of_dropped_nodes() -> None:
    a = DraftTree.chain([1, 2], "a")
    b = DraftTree()
    x = b.add(ROOT, 7, "b")
    b.add(x, 8, "b")
    b.add(ROOT, 9, "b")
    merged = merge_trees([a, b], budget=3)
    assert merged.tokens == [1, 2, 7]  # 8 (child of 7) and 9 do not fit
    merged = merge_trees([b, a], budget=2)
    assert merged.tokens == [7, 8]


def test_layout_positions_and_ancestor_mask() -> None:
    t = DraftTree()
    a = t.add(ROOT, 5, "s")
    t.add(ROOT, 6, "s")
    t.add(a, 7, "s")
    lay = tree_layout(root=4, tree=t, start=100)
    assert lay.input_ids.tolist() == [[4, 5, 6, 7]]
    assert lay.position_ids.tolist() == [[100, 101, 101, 102]]
    expect = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(lay.ancestor_mask, expect)
