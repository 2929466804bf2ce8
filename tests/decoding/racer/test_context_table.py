"""Context-keyed logit cues on literal token lists: feeding, backoff order, the bound, and the paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.drafter import DraftRequest, PromptInfo, VerifyOutcome
from decoding.drafters.racer import ContextTable, LogitsTable, RacerConfig, RacerDrafter, logits_paths
from decoding.tree import ROOT


def _rows(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


def test_prompt_rows_are_keyed_by_trigram_and_bigram_latest_occurrence_wins() -> None:
    table = ContextTable(k=2)
    #            0  1  2  3  4  5
    ids = [1, 2, 3, 1, 2, 4]
    table.feed_prompt(ids, _rows([10, 11], [20, 21], [30, 31], [40, 41], [50, 51], [60, 61]))
    # (3, 1, 2) ends at 4; the bigram (1, 2) ends at 1 and at 4: the later row wins
    assert table.lookup([3, 1, 2]) == [(3, [50, 51]), (2, [50, 51])]
    assert table.lookup([9, 1, 2]) == [(2, [50, 51])]  # unknown trigram: backs off to the bigram
    assert table.lookup([0, 1, 2, 3]) == [(3, [30, 31]), (2, [30, 31])]  # only the last 3 tokens count
    assert table.lookup([7, 8]) == []
    assert table.lookup([2]) == []  # order 1 is the shared logits table's job
    assert len(table) == 4 + 4  # trigrams (1,2,3) (2,3,1) (3,1,2) (1,2,4); bigrams 12 23 31 24 (12 twice)


def test_k_truncates_and_negative_ids_are_dropped() -> None:
    table = ContextTable(k=3)
    table.feed_prompt([5, 6], _rows([1, 2, 3, 4], [7, -1, 8, 9]))
    assert table.lookup([5, 6]) == [(2, [7, 8])]


def test_feed_keys_each_row_by_its_context_and_the_bound_keeps_known_keys_fresh() -> None:
    table = ContextTable(k=2, max_entries=2)
    table.feed([(1, 2, 3), (4, 5)], _rows([9, 8], [7, 6]))
    assert table.lookup([1, 2, 3]) == [(3, [9, 8]), (2, [9, 8])]
    assert table.lookup([4, 5]) == [(2, [7, 6])]
    table.feed([(0, 7, 7), (2, 3)], _rows([1, 1], [5, 5]))  # a new trigram fits (1 of 2), a new bigram not
    assert table.lookup([0, 7, 7]) == [(3, [1, 1])]
    assert table.lookup([9, 2, 3]) == [(2, [5, 5])]  # (2, 3) was known: updated
    table.feed([(6, 6, 6)], _rows([3, 3]))  # the trigram map is full now: dropped
    assert table.lookup([6, 6, 6]) == []


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        ContextTable(k=0)
    with pytest.raises(ValueError):
        ContextTable(max_entries=0)


def _token_table(vocab: int = 100) -> LogitsTable:
    table = LogitsTable(vocab, 4)
    ids = np.arange(vocab)
    table.update(ids, np.stack([(ids + 1) % vocab, (ids + 2) % vocab, (ids + 3) % vocab, (ids + 4) % vocab], 1))
    return table


def test_logits_paths_take_the_longest_context_first_then_back_off_without_repeats() -> None:
    tokens = _token_table()
    ctx = ContextTable(k=4)
    ctx.feed([(1, 2, 50), (2, 50)], _rows([60, 51, 70, 71], [80, 60, 81, 82]))
    tree = logits_paths(tokens, 50, budget=4, breadth=4, contexts=ctx, before=[1, 2])
    first = [i for i, p in enumerate(tree.parents) if p == ROOT]
    assert [tree.tokens[i] for i in first] == [60, 51, 70, 71]
    assert [tree.kinds[i] for i in first] == [f"racer.logits/o3r{j}" for j in range(4)]
    # another left context: the trigram is unknown, the bigram (2, 50) leads, then the token's own row
    tree = logits_paths(tokens, 50, budget=4, breadth=4, contexts=ctx, before=[9, 2])
    assert tree.tokens == [80, 60, 81, 82]
    tree = logits_paths(tokens, 50, budget=6, breadth=6, contexts=ctx, before=[9, 2])
    assert tree.tokens[:6] == [80, 60, 81, 82, 51, 52]  # the token row follows, 51 52 (53 54 cut by breadth)
    assert tree.kinds[4:6] == ["racer.logits/o1r3", "racer.logits/o1r3"]
    # children are looked up under their own context: (2, 50, 60) -> nothing; (50, 60) -> a bigram row
    ctx.feed([(50, 60)], _rows([99, 98, 97, 96]))
    tree = logits_paths(tokens, 50, budget=5, breadth=4, contexts=ctx, before=[1, 2])
    assert tree.parents[4] == 0 and tree.tokens[4] == 99 and tree.kinds[4] == "racer.logits/o2r0"
    # without a context table: the token rows only (the engine-wide cue)
    assert logits_paths(tokens, 50, budget=3, breadth=3).tokens == [51, 52, 53]


def test_drafter_feeds_contexts_from_the_prompt_and_from_every_verified_node() -> None:
    table = LogitsTable(200, 4)
    drafter = RacerDrafter(RacerConfig(topk=4, min_context=9, max_ngram=10, context_cues=True), table)
    prompt = [1, 2, 3, 4]
    drafter.begin(PromptInfo(prompt_ids=prompt, prompt_topk=_rows([5] * 4, [6] * 4, [7] * 4, [8, 9, 10, 11])))
    assert drafter.contexts is not None
    assert drafter.contexts.lookup([2, 3, 4]) == [(3, [8, 9, 10, 11]), (2, [8, 9, 10, 11])]
    # first root 20 follows the prompt: its context is (3, 4, 20)
    tree = drafter.propose(DraftRequest(root=20, generated=[20], budget=4))
    assert len(tree) == 0
    tree.add(ROOT, 21, "other")
    tree.add(0, 22, "other")
    tree.add(ROOT, 23, "other")
    topk = _rows([21, 0, 0, 0], [22, 1, 1, 1], [30, 2, 2, 2], [40, 3, 3, 3])
    drafter.observe(VerifyOutcome(root=20, tree=tree, accepted_nodes=[0, 1], new_tokens=[21, 22, 30],
                                  node_topk=topk, generated=[20]))
    ctx = drafter.contexts
    assert ctx.lookup([3, 4, 20])[0] == (3, [21, 0, 0, 0])
    assert ctx.lookup([4, 20, 21])[0] == (3, [22, 1, 1, 1])
    assert ctx.lookup([20, 21, 22])[0] == (3, [30, 2, 2, 2])
    assert ctx.lookup([4, 20, 23])[0] == (3, [40, 3, 3, 3])  # a rejected node's context too
    # later, the same left context again: the trigram row leads the root's candidates
    nxt = drafter.propose(DraftRequest(root=20, generated=[20, 21, 22, 30, 3, 4, 20], budget=2))
    assert nxt.tokens[0] == 21 and nxt.kinds[0] == "racer.logits/o3r0"


def test_context_cues_are_off_by_default() -> None:
    drafter = RacerDrafter(RacerConfig(), LogitsTable(50, 4))
    drafter.begin(PromptInfo(prompt_ids=[1, 2], prompt_topk=_rows([3, 4, 5, 6], [7, 8, 9, 10])))
    assert drafter.contexts is None
    tree = drafter.propose(DraftRequest(root=2, generated=[2], budget=2))
    assert tree.tokens == [7, 8] and tree.kinds == ["racer.logits/o1r0", "racer.logits/o1r1"]
