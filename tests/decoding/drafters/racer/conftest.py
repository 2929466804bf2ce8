"""Helpers for the RACER tests: a scripted verify loop."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decoding.speculative.drafter import DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.tree import ROOT as TREE_ROOT
from decoding.speculative.tree import DraftTree


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
