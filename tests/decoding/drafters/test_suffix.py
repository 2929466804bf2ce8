"""The suffix drafter: the longest exact match of the text's end, kept incrementally, drafted as one chain labelled
by match length; lossless in the engine whatever it drafts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from decoding.drafters.racer import CrossSessionConfig, InProcessSharedTier
from decoding.drafters.registry import DraftingKit, build_drafters
from decoding.drafters.suffix import (
    MATCH_BUCKETS,
    SuffixDrafter,
    SuffixIndex,
    TokenText,
    longest_suffix,
    match_label,
    match_prior,
)
from decoding.speculative.drafter import DraftRequest, PromptInfo
from decoding.speculative.engine import Engine
from decoding.speculative.generation import Prompt
from decoding.speculative.tree import ROOT
from tests.decoding.conftest import PROMPT, VOCAB, TinyTarget, fixed_cost_policy, naive_greedy, run


def brute(text: list[int], most: int) -> int:
    """The longest suffix of ``text`` (at most ``most``) that also ends before its last token."""
    best = 0
    for length in range(1, min(most, len(text) - 1) + 1):
        suffix = text[len(text) - length :]
        if not any(text[e - length : e] == suffix for e in range(length, len(text))):
            break
        best = length
    return best


def test_longest_suffix_finds_the_most_recent_occurrence() -> None:
    hay = np.array([1, 2, 3, 9, 1, 2, 3, 7, 2, 3])
    assert longest_suffix(hay, np.array([5, 1, 2, 3]), 64) == (3, 7)  # "1 2 3" last ended at 6: continue at 7
    assert longest_suffix(hay, np.array([8, 8]), 64) == (0, -1)
    assert longest_suffix(hay, np.array([1, 2, 3]), 2) == (2, 10)  # capped at 2 tokens: "2 3", most recent


@pytest.mark.parametrize("seed", range(4))
def test_the_kept_match_equals_a_fresh_search_as_the_text_grows(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        vocab = rng.choice([2, 3, 5])
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(3, 80))]
        text, index, i = TokenText(seq[:2]), SuffixIndex(8), 2
        while i < len(seq):
            step = rng.randrange(1, 5)  # a step appends accepted tokens + the bonus
            text.extend(seq[i : i + step])
            i += step
            m = index.update(text)
            now = seq[: min(i, len(seq))]
            assert m.length == brute(now, 8)
            if m.length:  # the occurrence is real and ends before the text does
                assert now[m.end - m.length : m.end] == now[len(now) - m.length :] and m.end < len(now)


def test_a_copied_span_is_drafted_as_one_chain_labelled_by_match_length() -> None:
    drafter = SuffixDrafter(max_draft=5)
    drafter.begin(PromptInfo(prompt_ids=[9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9]))
    tree = drafter.propose(DraftRequest(root=2, generated=[1, 2], budget=16))  # "9 1 2" occurred: "3 4 5 ..." next
    assert tree.tokens == [3, 4, 5, 6, 7]
    assert tree.parents == [ROOT, 0, 1, 2, 3]
    assert tree.kinds == [f"suffix/m{match_label(n)}" for n in (3, 4, 5, 6, 7)]
    assert len(drafter.propose(DraftRequest(root=2, generated=[1, 2], budget=3))) == 3  # the budget cuts it
    assert len(drafter.propose(DraftRequest(root=77, generated=[1, 2, 77], budget=16))) == 0  # no match: nothing


def test_priors_rise_with_the_match_length_and_cover_every_label() -> None:
    priors = [match_prior(b) for b in MATCH_BUCKETS]
    assert priors == sorted(priors) and 0 < priors[0] < priors[-1] < 1
    assert set(SuffixDrafter.priors) == {f"{source}/m{b}@{d}" for source in ("suffix", "suffix.session")
                                         for b in MATCH_BUCKETS for d in (1, 2, 3)}


def test_registry_modes_run_it() -> None:
    assert [d.name for d in build_drafters("suffix", DraftingKit())] == ["suffix"]


N = 40


def test_lossless_in_the_engine(tiny: TinyTarget) -> None:
    """A prompt that repeats itself, so the drafter's chains are long and some land: the answer is plain greedy's."""
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38] * 4
    prompt = Prompt(ids[:-1], ids[-1:])
    reference = naive_greedy(tiny.model, prompt.ids, N)
    for budget in (None, 4, 24):
        done = run(Engine(tiny), prompt, N, [SuffixDrafter()], budget)
        assert done.token_ids == reference
        assert done.stats.draft_s_by_drafter["suffix"] > 0
    done = run(Engine(tiny), PROMPT, N, [SuffixDrafter()], None)
    assert done.token_ids == naive_greedy(tiny.model, PROMPT.ids, N)
    assert all(0 <= t < VOCAB for t in done.token_ids)


def test_earlier_answers_over_the_same_documents_draft_a_repeated_answer() -> None:
    """A tenant's earlier answer in the same scope: the text's end matched in it, drafted as ``suffix.session``
    where it matches longer than the text itself; another scope or another tenant drafts nothing from it."""
    tier = InProcessSharedTier(CrossSessionConfig())
    earlier = [40, 41, 42, 43, 44, 45, 46, 47]
    tier.cache("m", "t", "acme").add_answer("doc-a", earlier)
    prompt = PromptInfo(prompt_ids=[1, 2, 3, 40], scope="doc-a")
    drafter = SuffixDrafter(tier.cache("m", "t", "acme"))
    drafter.begin(prompt)
    tree = drafter.propose(DraftRequest(root=41, generated=[41], budget=16))  # "40 41" is the earlier answer's start
    assert tree.tokens == earlier[2:] and set(tree.sources) == {"suffix.session"}
    assert tree.kinds[0] == f"suffix.session/m{match_label(2)}"
    for tenant, scope in (("globex", "doc-a"), ("acme", "doc-b")):
        other = SuffixDrafter(tier.cache("m", "t", tenant))
        other.begin(PromptInfo(prompt_ids=[1, 2, 3, 40], scope=scope))
        assert len(other.propose(DraftRequest(root=41, generated=[41], budget=16))) == 0


def test_two_matches_share_their_common_start() -> None:
    tier = InProcessSharedTier(CrossSessionConfig())
    tier.cache("m", "t", "a").add_answer("", [7, 8, 9, 1, 2, 3, 55, 56])
    drafter = SuffixDrafter(tier.cache("m", "t", "a"))
    drafter.begin(PromptInfo(prompt_ids=[5, 8, 9, 1, 2, 3, 4, 6, 7]))  # own text: "8 9" -> "1 2 3 4 6"
    tree = drafter.propose(DraftRequest(root=9, generated=[8, 9], budget=16))  # earlier: "7 8 9" -> "1 2 3 55 56"
    assert tree.tokens == [1, 2, 3, 55, 56, 4, 6, 7, 8, 9]
    assert tree.sources[:5] == ["suffix.session"] * 5 and tree.parents[5] == 2  # "4" branches off after "3"


def test_a_repeated_question_is_drafted_from_the_earlier_answer_exactly(tiny: TinyTarget) -> None:
    """The service keeps each answer in the tier (``Drafters.learn``); the same tenant asking again over the same
    documents drafts the earlier answer as long chains, the answer unchanged; another tenant does not."""
    prompt = Prompt([5, 17, 3, 42, 8], [23, 61, 9], prefix_key="doc-a")
    reference = naive_greedy(tiny.model, prompt.ids, N)
    tier = InProcessSharedTier(CrossSessionConfig())
    engine = Engine(tiny, policy=fixed_cost_policy())  # the steps saved, not this box's load, decide the chains
    first = run(engine, prompt, N, [SuffixDrafter(tier.cache(tiny.name, "", "acme"))], None)
    assert first.token_ids == reference and first.stats.drafted_by_source.get("suffix.session", 0) == 0
    tier.cache(tiny.name, "", "acme").add_answer("doc-a", first.token_ids)
    again = run(engine, prompt, N, [SuffixDrafter(tier.cache(tiny.name, "", "acme"))], None)
    assert again.token_ids == reference
    assert again.stats.accepted_by_source["suffix.session"] > N // 2 and again.stats.steps < first.stats.steps // 2
    stranger = run(engine, prompt, N, [SuffixDrafter(tier.cache(tiny.name, "", "globex"))], None)
    assert stranger.token_ids == reference and stranger.stats.drafted_by_source.get("suffix.session", 0) == 0
