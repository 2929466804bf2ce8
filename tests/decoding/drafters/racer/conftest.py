"""Helpers for the RACER tests: a brute-force n-gram oracle, automaton invariants, a scripted verify loop."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoding.drafters.racer.automaton import NONE, ROOT, NgramAutomaton
from decoding.speculative.drafter import DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.tree import ROOT as TREE_ROOT
from decoding.speculative.tree import DraftTree


def oracle_counts(text: Sequence[int], max_ngram: int) -> dict[tuple[int, ...], int]:
    """Every window of 1..max_ngram tokens of ``text`` with its number of occurrences."""
    counts: Counter[tuple[int, ...]] = Counter()
    for i in range(len(text)):
        for j in range(i + 1, min(len(text), i + max_ngram) + 1):
            counts[tuple(text[i:j])] += 1
    return dict(counts)


def last_end(text: Sequence[int], s: tuple[int, ...]) -> int:
    """End position of the latest occurrence of ``s`` in ``text`` (-1 if none)."""
    n = len(s)
    for end in range(len(text) - 1, n - 2, -1):
        if tuple(text[end - n + 1 : end + 1]) == s:
            return end
    return -1


def strings(auto: NgramAutomaton) -> dict[tuple[int, ...], int]:
    return {auto.string(n): auto.count(n) for n in auto.nodes() if n != ROOT}


def check_invariants(auto: NgramAutomaton, text: Sequence[int], exact: bool) -> None:
    """Structure, links and counts of ``auto`` against the brute-force oracle of ``text``."""
    d_max = auto.max_ngram
    oracle = oracle_counts(text, d_max)
    live = list(auto.nodes())
    assert len(live) == len(auto) <= auto.max_nodes
    for n in live[1:]:
        s = auto.string(n)
        assert 1 <= len(s) == auto.depth(n) <= d_max
        p = auto.parent(n)
        assert auto.alive(p) and auto.child(p, s[-1]) == n  # no orphan
        link = auto.link(n)
        assert auto.alive(link) and auto.string(link) == s[1:]  # suffix link correct and alive
        assert s in oracle and 1 <= auto.count(n) <= oracle[s]
        if link != ROOT:
            assert auto.count(n) <= auto.count(link)
        assert sum(auto.count(c) for _, c in auto.children(n)) <= auto.count(n)
        assert auto.stamp(n) == last_end(text, s)
    assert auto.link(ROOT) == NONE
    if exact:
        assert strings(auto) == oracle
    k = min(len(text), d_max - 1)
    assert auto.string(auto.state) == tuple(text[len(text) - k :])
    for j in range(1, min(len(text), d_max) + 1):  # every window ending at the last token is held
        assert auto.lookup(text[len(text) - j :]) != NONE


class LruOracle:
    """Brute-force model of the automaton with its eviction policy: string -> [count, stamp].

    After each token, while over the bound (root included), drop the string with the oldest stamp that
    is neither a proper prefix nor a proper suffix of another held string and was not touched now.
    """

    def __init__(self, max_ngram: int, max_nodes: int) -> None:
        self.max_ngram, self.max_nodes = max_ngram, max_nodes
        self.nodes: dict[tuple[int, ...], list[int]] = {}
        self.text: list[int] = []

    def feed(self, tok: int) -> None:
        now = len(self.text)
        self.text.append(tok)
        for j in range(1, min(len(self.text), self.max_ngram) + 1):
            entry = self.nodes.setdefault(tuple(self.text[-j:]), [0, now])
            entry[0] += 1
            entry[1] = now
        while len(self.nodes) + 1 > self.max_nodes:
            prefixes = {s[:-1] for s in self.nodes}
            suffixes = {s[1:] for s in self.nodes}
            cands = [(e[1], s) for s, e in self.nodes.items() if s not in prefixes and s not in suffixes
                     and e[1] < now]
            if not cands:
                break
            assert len({c[0] for c in cands}) == len(cands)  # stamps of evictable strings are unique
            del self.nodes[min(cands)[1]]

    def state(self) -> dict[tuple[int, ...], tuple[int, int]]:
        return {s: (e[0], e[1]) for s, e in self.nodes.items()}


def held(auto: NgramAutomaton) -> dict[tuple[int, ...], tuple[int, int]]:
    return {auto.string(n): (auto.count(n), auto.stamp(n)) for n in auto.nodes() if n != ROOT}


def longest_held_suffix(auto: NgramAutomaton, query: Sequence[int]) -> tuple[int, ...]:
    held = set(strings(auto))
    for k in range(min(len(query), auto.max_ngram - 1), 0, -1):
        s = tuple(query[len(query) - k :])
        if s in held:
            return s
    return ()


def verify_against(tree: DraftTree, truth: Sequence[int], pos: int) -> list[int]:
    """Greedy acceptance of ``tree`` when the target's output is ``truth`` and the root is truth[pos]."""
    kids = tree.children()
    node, accepted = TREE_ROOT, []
    while pos + 1 < len(truth):
        nxt = [i for i in kids[node + 1] if tree.tokens[i] == truth[pos + 1]]
        if not nxt:
            break
        node = nxt[0]
        accepted.append(node)
        pos += 1
    return accepted


@dataclass
class Run:
    output: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0
    trees: list[DraftTree] = field(default_factory=list)
    accepted_by_source: Counter[str] = field(default_factory=Counter)


def scripted_run(
    drafter: object, prompt: Sequence[int], answer: Sequence[int], budget: int, topk_token: int = 0,
    between_steps: object = None,
) -> Run:
    """Drive a drafter as the engine would, with a target whose greedy output is ``answer``.

    The target's "top-k" reported to ``observe`` is always ``topk_token`` (k = 8 copies), so the logits
    table learns nothing useful unless a test wants it to.
    """
    run = Run()
    drafter.begin(PromptInfo(prompt_ids=list(prompt)))  # type: ignore[attr-defined]
    run.output = [answer[0]]
    pos = 0
    while pos + 1 < len(answer):
        root = answer[pos]
        tree = drafter.propose(DraftRequest(root=root, generated=list(run.output), budget=budget))  # type: ignore[attr-defined]
        run.trees.append(tree)
        acc = verify_against(tree, answer, pos)
        pos += len(acc)
        new = [tree.tokens[i] for i in acc]
        if pos + 1 < len(answer):
            new.append(answer[pos + 1])
        pos += 1
        topk = torch.full((len(tree) + 1, 8), topk_token, dtype=torch.long)
        outcome = VerifyOutcome(root=root, tree=tree, accepted_nodes=acc, new_tokens=new, node_topk=topk)
        drafter.observe(outcome)  # type: ignore[attr-defined]
        run.output.extend(new)
        run.steps += 1
        run.accepted += len(acc)
        for i in acc:
            run.accepted_by_source[tree.sources[i]] += 1
        if callable(between_steps):
            between_steps()
    drafter.end(run.output)  # type: ignore[attr-defined]
    assert run.output == list(answer)
    return run
