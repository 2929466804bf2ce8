"""Drafting from the cross-session tier's continuation counts: the part RACER runs each step.

A tenant's earlier answers are in the tier as (context -> continuations). Each step the context is the
text's last ``context_len`` tokens before the root; the continuations starting with the root become a
small trie of paths (``shared_paths``). This pays where an answer repeats an earlier one (greedy decoding
answers the same question over the same document the same way, so a second session drafts whole
stretches of it) and costs a dict lookup per step elsewhere. With a remote tier (Redis), each step also
asks for the contexts the next step may need (after the root alone, or after accepting a path of this
step's tree), so the next lookup finds them in the local mirror without waiting.

A tier continuation keyed by a few tokens is right when the answer repeats an earlier one and mostly wrong
elsewhere, so the budget policy must not learn one acceptance rate for both. Each step's nodes carry the
tier's current *streak* in their kind (``racer.cross_session/h0``, ``/h1``, ``/h2``): how many steps in a row
the tier's best next token was the token the target then produced, whether or not that draft was
verified. An unverified guess is checked for free against the next token, so a repeat is recognised even
while the policy, taught by wrong continuations, verifies none of the tier's drafts.

(The service's default drafts earlier answers from the tier's whole answers instead, by exact longest match:
``decoding.drafters.suffix``. The counts' paths on their own, as a mode's drafter ahead of it, measured worse:
where both drafted the same tokens, the nodes kept the counts' labels, whose learned acceptance is lower, and the
budget policy cut the chain short.)
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.drafters.racer.cross_session import CrossSessionCache
from decoding.drafters.racer.paths import SOURCE_CROSS_SESSION, shared_paths
from decoding.speculative.tree import DraftTree


class TierDraft:
    """One request's view of the tier: where the text stands, and the paths the tier knows from there."""

    def __init__(self, shared: CrossSessionCache, prefetch_nodes: int = 8) -> None:
        self.shared = shared
        self.prefetch_nodes = prefetch_nodes
        self._prompt_tail: list[int] = []
        self._guess: tuple[int, int] | None = None  # (position in the text, token) of the last best path's head
        self._streak = 0

    def begin(self, prompt_ids: Sequence[int]) -> None:
        n = self.shared.context_len
        self._prompt_tail = [int(t) for t in prompt_ids[-n:]]
        self._guess, self._streak = None, 0
        self.shared.prefetch([self._prompt_tail])  # the context of the first root

    def paths(self, generated: Sequence[int], budget: int) -> DraftTree:
        """Paths below the root (the last of ``generated``) from the continuations of the context before it."""
        self._score_guess(generated)
        tail = self._tail(generated)
        conts = self.shared.continuations(tail[:-1])
        kind = f"{SOURCE_CROSS_SESSION}/h{min(self._streak, 2)}"
        tree = shared_paths(conts, tail[-1], budget, kind=kind) if conts else DraftTree()
        self._guess = (len(generated), tree.tokens[0]) if len(tree) else None
        return tree

    def _score_guess(self, generated: Sequence[int]) -> None:
        """Extend the streak when the text went on with the last step's best guess, else reset it."""
        if self._guess is None:
            self._streak = 0
            return
        at, token = self._guess
        if at < len(generated):
            self._streak = self._streak + 1 if int(generated[at]) == token else 0

    def prefetch_after(self, generated: Sequence[int], tree: DraftTree) -> None:
        """With a remote tier: ask for the contexts the next step may need."""
        if not self.shared.remote:
            return
        tail = self._tail(generated)
        n = self.shared.context_len
        contexts = [tail[-n:]]
        for node in range(min(len(tree), self.prefetch_nodes)):
            contexts.append((tail + [tree.tokens[i] for i in tree.path_to(node)])[-n:])
        self.shared.prefetch(contexts)

    def learn(self, output_ids: Sequence[int]) -> None:
        if output_ids:
            self.shared.learn([*self._prompt_tail, *output_ids], len(self._prompt_tail))

    def _tail(self, generated: Sequence[int]) -> list[int]:
        """The last ``context_len + 1`` tokens of prompt + generated (the root last)."""
        n = self.shared.context_len + 1
        got = [int(t) for t in generated[-n:]]
        if len(got) < n:
            got = self._prompt_tail[max(0, len(self._prompt_tail) - (n - len(got))) :] + got
        return got
