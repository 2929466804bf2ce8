"""The ``Drafter`` protocol: anything that proposes a draft tree below the root each step.

The engine never knows who drafted: it asks every drafter for a tree, merges them in the order given,
verifies once, and reports the outcome back to every drafter through ``observe``. ``BaseDrafter`` gives
every hook a no-op default, so a drafter implements only what it uses (usually ``propose``).

No drafting is free: the engine times every drafter's ``propose`` and charges it (``TreeSelector.drafter_on``:
a drafter whose accepted tokens do not pay for its time and its verified rows is skipped). An LM drafter pays
per drafted token (a forward each): it reports its measured seconds per drafted token in ``step_cost_s``, and
the engine decides each step how deep it may draft (``DraftRequest.max_depth``, 0: skip this step) from that
cost, the verify-cost curve and the learned acceptance of its tokens (``decoding.speculative.budget``). One
that must read its own prompt before its first draft reports those tokens in ``setup_tokens`` and does the
work in its first ``propose`` with a depth, which the engine grants only where it pays back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from decoding.speculative.tree import DraftTree


@dataclass(frozen=True)
class PromptInfo:
    """What a drafter may learn from the target's prompt at the start of a request.

    ``prompt_topk`` (optional) holds the target's top-k next-token ids at every prompt position
    (``[len(prompt_ids), k]`` long, row j predicts position j + 1), computed once per document prefix.
    """

    prompt_ids: Sequence[int]
    prompt_topk: torch.Tensor | None = None
    draft_ids: Sequence[int] | None = None  # the RAG drafter's prompt ([system][retrieved chunks][question])
    draft_rows: Sequence[tuple[int, int]] | None = None  # prompt rows [start, end) a KV-subset drafter reads
    target_cache: Any = None  # the target's KV cache (a KV-subset drafter drafts over it, then cuts it back)
    scope: str | None = None  # the documents the prompt reads (its prefix key): what earlier answers are keyed by


@dataclass(frozen=True)
class DraftRequest:
    """One step's question to a drafter.

    ``root`` is the token already decided by the target and not yet verified in the KV cache;
    ``generated`` holds every generated token so far, ``root`` last. ``budget`` is the most unique nodes
    this drafter's tree may hold (excluding the root). ``max_depth`` bounds the depth of what a drafter with
    a cost per token (``step_cost_s``) drafts this step (None: its own limit; 0: nothing).
    """

    root: int
    generated: Sequence[int]
    budget: int
    max_depth: int | None = None


@dataclass(frozen=True)
class VerifyOutcome:
    """What one verify pass found, reported to every drafter.

    ``tree`` is the merged tree that was verified; ``accepted_nodes`` the accepted node indices (root
    excluded) in path order; ``new_tokens`` the tokens appended to the output by this step: the accepted
    node tokens followed by the next root (bonus / recovered token). ``node_topk`` is the target's
    top-k prediction after the root (row 0) and after every node (row i + 1), ``[n + 1, k]`` long:
    rejected nodes included, for logit-cue tables; None unless a drafter of the request asked for it
    (``uses_node_topk``: a top-k over the vocabulary at every verified row is host work each step pays).
    ``generated`` is the output before this step's new tokens (``root`` last, as in ``DraftRequest``; empty
    when the caller does not say): the context of the root and of every node.
    """

    root: int
    tree: DraftTree
    accepted_nodes: Sequence[int]
    new_tokens: Sequence[int]
    node_topk: torch.Tensor | None
    generated: Sequence[int] = ()


@runtime_checkable
class Drafter(Protocol):
    """A source of draft tokens. ``name`` labels its nodes in stats (``accepted_by_source``).

    ``step_cost_s``: measured seconds per drafted token (0: free, never rationed); ``max_depth``: the deepest
    chain a costed drafter offers (its gamma; 0 for a free drafter, whose depth the budget alone bounds);
    ``uses_node_topk``: whether ``observe`` reads ``VerifyOutcome.node_topk`` (only then is it computed);
    ``setup_tokens``: prompt tokens it must still read before its first draft (0: none); ``relative_cost``: a
    costed drafter's expected cost per token against a target step until it has measured its own (its model's
    weights against the target's: 1.0, as dear as the target); ``priors``: what
    it expects of its node kinds before any is verified (``AcceptanceModel.seed``: statistics keys, kind@depth).
    """

    name: str
    step_cost_s: float
    max_depth: int
    uses_node_topk: bool
    setup_tokens: int
    relative_cost: float
    priors: dict[str, float]

    def begin(self, prompt: PromptInfo) -> None:
        """Start a request over ``prompt`` (called once, after the target's prefill)."""

    def propose(self, request: DraftRequest) -> DraftTree:
        """Return a tree of at most ``request.budget`` nodes below ``request.root`` (may be empty)."""

    def observe(self, outcome: VerifyOutcome) -> None:
        """Learn from a verify step (accepted tokens, target top-k at every node)."""

    def end(self, output_ids: Sequence[int]) -> None:
        """The request finished with ``output_ids`` (generated tokens); persist what is worth keeping."""

    def reset(self) -> None:
        """Drop all per-request state."""


class BaseDrafter:
    """A drafter with every hook a no-op and no cost per drafted token; subclasses override what they use."""

    name = "base"
    step_cost_s = 0.0  # measured seconds per drafted token (0: free, never rationed)
    max_depth = 0  # the deepest chain a costed drafter offers (its gamma)
    uses_node_topk = False  # observe reads the target's top-k at every verified row
    setup_tokens = 0  # prompt tokens it must read before its first draft (an LM drafter's deferred prefill)
    relative_cost = 1.0  # a costed drafter's cost per token against a target step, until measured
    priors: dict[str, float] = {}  # noqa: RUF012  (read only) expected acceptance of its kinds, by statistics key

    def begin(self, prompt: PromptInfo) -> None:
        return None

    def propose(self, request: DraftRequest) -> DraftTree:
        return DraftTree()

    def observe(self, outcome: VerifyOutcome) -> None:
        return None

    def end(self, output_ids: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        return None
