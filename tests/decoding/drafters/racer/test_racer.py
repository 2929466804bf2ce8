"""The RACER drafter through the Drafter protocol, without a model (a scripted target)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from decoding.drafters.racer import (
    SOURCE_CROSS_SESSION,
    SOURCE_LOGITS,
    SOURCE_RETRIEVAL,
    CrossSessionConfig,
    InProcessSharedTier,
    LogitsTable,
    RacerConfig,
    RacerDrafter,
    RacerFactory,
)
from decoding.drafters.suffix import match_label
from decoding.speculative.drafter import Drafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.tree import ROOT
from tests.decoding.drafters.racer.conftest import scripted_run

VOCAB = 500


def test_source_labels_are_stable() -> None:
    assert (SOURCE_RETRIEVAL, SOURCE_LOGITS, SOURCE_CROSS_SESSION) == (
        "racer.retrieval", "racer.logits", "racer.cross_session")
    drafter = RacerDrafter(RacerConfig(), LogitsTable(VOCAB))
    assert isinstance(drafter, Drafter) and drafter.name == "racer"


def test_config_is_validated() -> None:
    for bad in ({"max_match": 0}, {"max_retrieval": 0}, {"topk": 0}):
        with pytest.raises(ValueError):
            RacerConfig(**bad)  # type: ignore[arg-type]
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
    drafter = RacerDrafter(RacerConfig(), table)
    drafter.begin(PromptInfo(prompt_ids=prompt))
    tree = drafter.propose(DraftRequest(root=22, generated=[20, 21, 22], budget=budget))
    pairs = {(p, t) for p, t in zip(tree.parents, tree.tokens, strict=True)}
    assert len(pairs) == len(tree) == budget  # unique nodes, budget filled exactly
    retrieval = tree.sources.count(SOURCE_RETRIEVAL)
    # the longest match ("30 31 20 21 22", 5 tokens) went on 23 24 29 30 31 20 21 22 (to the text's end): one chain,
    # labelled by match length
    chain = [23, 24, 29, 30, 31, 20, 21, 22]
    assert tree.tokens[: min(budget, 8)] == chain[:budget]
    assert retrieval == min(budget, 8) and tree.kinds[0] == f"racer.retrieval/m{match_label(5)}"
    if budget > 8:
        assert tree.sources.count(SOURCE_LOGITS) == budget - retrieval > 0
        assert len(tree.children()[0]) > 1  # logits add alternatives beside the retrieval chain
    for i, p in enumerate(tree.parents):
        assert p == ROOT or p < i


def test_propose_keeps_the_retrieval_match_in_step_with_the_output() -> None:
    drafter = RacerDrafter(RacerConfig(), LogitsTable(VOCAB))
    drafter.begin(PromptInfo(prompt_ids=[1, 2, 3]))
    assert drafter.propose(DraftRequest(root=4, generated=[4], budget=0)).tokens == []
    tree = drafter.propose(DraftRequest(root=2, generated=[4, 1, 2], budget=4))
    assert len(drafter.retrieval.text) == 6 and tree.tokens[:2] == [3, 4]  # "1 2" occurred: "3 4" after it
    assert drafter.retrieval.index.match.length == 2
    # without begin: a match in the output alone
    lone = RacerDrafter(RacerConfig(), LogitsTable(VOCAB))
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
    factory = RacerFactory(RacerConfig(), table, tier, model_id="tiny", tokenizer_hash="t0")
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [300 + (i * 37) % 150 for i in range(40)]  # no repeats: retrieval has nothing
    first = scripted_run(factory.drafter("acme"), prompt, answer, budget=8, topk_token=VOCAB - 1)
    second = scripted_run(factory.drafter("acme"), [*prompt, 9], answer, budget=8, topk_token=VOCAB - 1)
    other = scripted_run(factory.drafter("globex"), [*prompt, 9], answer, budget=8, topk_token=VOCAB - 1)
    assert first.accepted == 0 and other.accepted == 0
    assert second.accepted_by_source[SOURCE_CROSS_SESSION] > len(answer) // 2
    assert second.steps < first.steps // 2


