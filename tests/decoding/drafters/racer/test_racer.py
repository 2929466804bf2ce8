"""The RACER drafter through the Drafter protocol, without a model (a scripted target)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from decoding.drafters.racer import (
    SOURCE_CROSS_SESSION,
    SOURCE_LOGITS,
    SOURCE_RETRIEVAL,
    AutomatonCache,
    CrossSessionConfig,
    InProcessSharedTier,
    LogitsTable,
    RacerConfig,
    RacerDrafter,
    RacerFactory,
)
from decoding.speculative.drafter import Drafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.tree import ROOT
from tests.decoding.drafters.racer.conftest import scripted_run, strings

VOCAB = 500


def test_source_labels_are_stable() -> None:
    assert (SOURCE_RETRIEVAL, SOURCE_LOGITS, SOURCE_CROSS_SESSION) == (
        "racer.retrieval", "racer.logits", "racer.cross_session")
    drafter = RacerDrafter(RacerConfig(), LogitsTable(VOCAB))
    assert isinstance(drafter, Drafter) and drafter.name == "racer"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        RacerConfig(max_ngram=1)
    with pytest.raises(ValueError):
        RacerConfig(min_context=10)
    with pytest.raises(ValueError):
        RacerConfig(retrieval_share=1.5)
    with pytest.raises(ValueError):
        RacerConfig(max_nodes=10)
    with pytest.raises(ValueError):
        CrossSessionConfig(continuation_len=1)


def filled_table(overlap_with: list[int] | None = None) -> LogitsTable:
    table = LogitsTable(VOCAB, 8)
    ids = np.arange(VOCAB)
    rows = (ids[:, None] * 8 + np.arange(1, 9)[None, :]) % VOCAB
    if overlap_with:  # row of the root starts with the retrieval continuation
        rows[overlap_with[0], : len(overlap_with) - 1] = overlap_with[1:]
        for a, b in itertools.pairwise(overlap_with[1:]):
            rows[a, 0] = b
    table.update(ids, rows)
    return table


@pytest.mark.parametrize("budget", [1, 2, 5, 8, 16, 40])
def test_budget_counts_unique_nodes_after_merging(budget: int) -> None:
    prompt = [20, 21, 22, 23, 24, 25, 26, 27, 30, 31, 20, 21, 22, 23, 24, 29, 30, 31]
    # the logits table proposes the same tokens retrieval does: duplicates must not eat the budget
    table = filled_table(overlap_with=[22, 23, 24, 25, 26])
    cfg = RacerConfig(max_ngram=6, retrieval_share=0.5)
    drafter = RacerDrafter(cfg, table)
    drafter.begin(PromptInfo(prompt_ids=prompt))
    tree = drafter.propose(DraftRequest(root=22, generated=[20, 21, 22], budget=budget))
    pairs = {(p, t) for p, t in zip(tree.parents, tree.tokens, strict=True)}
    assert len(pairs) == len(tree) == budget  # unique nodes, budget filled exactly
    retrieval = tree.sources.count(SOURCE_RETRIEVAL)
    assert retrieval >= 1 and tree.tokens[0] == 23 and tree.sources[0] == SOURCE_RETRIEVAL
    # the strong match (... 20 21 22 -> 23 24) may take the budget; weak contexts only their share
    assert retrieval <= 2 + math.ceil(budget * cfg.retrieval_share)
    if budget >= 6:
        assert tree.sources.count(SOURCE_LOGITS) == budget - retrieval > 0
        assert len(tree.children()[0]) > 1  # logits add alternatives beside the retrieval chain
    for i, p in enumerate(tree.parents):
        assert p == ROOT or p < i


def test_propose_keeps_the_automaton_in_step_with_the_output() -> None:
    drafter = RacerDrafter(RacerConfig(max_ngram=4), LogitsTable(VOCAB))
    drafter.begin(PromptInfo(prompt_ids=[1, 2, 3]))
    assert drafter.propose(DraftRequest(root=4, generated=[4], budget=0)).tokens == []
    drafter.propose(DraftRequest(root=2, generated=[4, 1, 2], budget=4))
    assert drafter.automaton is not None
    assert drafter.automaton.position == 6
    assert strings(drafter.automaton)[(1, 2)] == 2
    # without begin: an automaton of the output alone
    lone = RacerDrafter(RacerConfig(max_ngram=4), LogitsTable(VOCAB))
    tree = lone.propose(DraftRequest(root=8, generated=[7, 8, 9, 7, 8], budget=4))
    assert tree.tokens[:1] == [9] and tree.sources[0] == SOURCE_RETRIEVAL


def test_observe_learns_the_targets_topk_after_every_node_rejected_included() -> None:
    table = LogitsTable(VOCAB, 4)
    drafter = RacerDrafter(RacerConfig(topk=4), table)
    drafter.begin(PromptInfo(prompt_ids=[1, 2, 3], prompt_topk=torch.tensor([[5, 6], [7, 8], [9, 10]])))
    assert table.next_tokens(3, 4) == [9, 10]  # from the prefill top-k
    tree = drafter.propose(DraftRequest(root=11, generated=[11], budget=4))
    assert len(tree) == 0  # nothing known after 11 yet
    tree.add(ROOT, 12, "other")
    tree.add(0, 13, "other")
    tree.add(ROOT, 14, "other")
    topk = torch.tensor([[12, 1, 2, 3], [13, 4, 4, 4], [40, 41, 42, 43], [50, 51, 52, 53]])
    drafter.observe(VerifyOutcome(root=11, tree=tree, accepted_nodes=[0, 1], new_tokens=[12, 13, 40],
                                  node_topk=topk))
    assert table.next_tokens(11, 4) == [12, 1, 2, 3]
    assert table.next_tokens(14, 4) == [50, 51, 52, 53]  # a rejected node's row too
    nxt = drafter.propose(DraftRequest(root=11, generated=[11, 12, 13, 40, 11], budget=3))
    assert nxt.tokens[0] == 12


def test_logits_paths_carry_a_repetitive_answer() -> None:
    """A scripted target whose top-1 is the truth: the logits table alone reaches high acceptance."""
    answer = [7, 8, 9, 10, 11] * 6
    table = LogitsTable(VOCAB, 8)
    table.update(answer[:-1], np.array([[b, 0, 0, 0, 0, 0, 0, 0] for b in answer[1:]]))
    drafter = RacerDrafter(RacerConfig(), table)
    run = scripted_run(drafter, [1, 2, 3], answer, budget=8, topk_token=0)
    assert run.accepted_by_source[SOURCE_LOGITS] > 0
    assert run.steps < len(answer) // 2


def test_retrieval_from_the_prompt_is_accepted() -> None:
    doc = list(range(100, 160))
    answer = doc[10:40]
    drafter = RacerDrafter(RacerConfig(), LogitsTable(VOCAB))
    run = scripted_run(drafter, [*doc, 1, 2], answer, budget=8, topk_token=VOCAB - 1)
    assert run.accepted_by_source[SOURCE_RETRIEVAL] >= len(answer) - 2 * run.steps
    assert run.steps <= 8


def test_second_session_benefits_in_process_and_tenants_are_isolated() -> None:
    tier = InProcessSharedTier(CrossSessionConfig())
    table = LogitsTable(VOCAB)
    factory = RacerFactory(RacerConfig(), table, tier, model_id="tiny", tokenizer_hash="t0",
                           automata=AutomatonCache(min_prefix=4))
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [300 + (i * 37) % 150 for i in range(40)]  # no repeats: retrieval has nothing
    first = scripted_run(factory.drafter("acme"), prompt, answer, budget=8, topk_token=VOCAB - 1)
    second = scripted_run(factory.drafter("acme"), [*prompt, 9], answer, budget=8, topk_token=VOCAB - 1)
    other = scripted_run(factory.drafter("globex"), [*prompt, 9], answer, budget=8, topk_token=VOCAB - 1)
    assert first.accepted == 0 and other.accepted == 0
    assert second.accepted_by_source[SOURCE_CROSS_SESSION] > len(answer) // 2
    assert second.steps < first.steps // 2


def test_automaton_snapshots_are_reused_across_questions() -> None:
    cache = AutomatonCache(min_prefix=8, margin=4)
    doc = [int(x) for x in np.random.default_rng(0).integers(0, 50, 300)]
    table = LogitsTable(VOCAB)
    questions = [[400, 401, 402], [400, 405], [410, 411, 412, 413]]
    for q in questions:
        drafter = RacerDrafter(RacerConfig(max_ngram=5), table, automata=cache)
        drafter.begin(PromptInfo(prompt_ids=[*doc, *q]))
        assert drafter.automaton is not None
        expected = RacerDrafter(RacerConfig(max_ngram=5), table)
        expected.begin(PromptInfo(prompt_ids=[*doc, *q]))
        assert expected.automaton is not None
        assert strings(drafter.automaton) == strings(expected.automaton)
        assert drafter.automaton.string(drafter.automaton.state) == tuple([*doc, *q][-4:])
    # q1 built whole; q2 shares doc + [400] with q1: a snapshot of that less the margin; q3 reuses it
    assert cache.builds == 2 and cache.hits == 1
    assert len(cache) == 1
