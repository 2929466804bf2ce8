"""Drafting from the cross-session tier: the part RACER runs each step, and the same part as a drafter alone.

A tenant's earlier answers are in the tier as (context -> continuations). Each step the context is the
text's last ``context_len`` tokens before the root; the continuations starting with the root become a
small trie of paths (``shared_paths``). This pays where an answer repeats an earlier one (greedy decoding
answers the same question over the same document the same way, so a second session drafts whole
stretches of it) and costs a dict lookup per step elsewhere. With a remote tier (Redis), each step also
asks for the contexts the next step may need (after the root alone, or after accepting a path of this
step's tree), so the next lookup finds them in the local mirror without waiting.

``CrossSessionDrafter`` is that part on its own, for modes that do not run RACER (the service's default
pairs it with prompt lookup). It only reads: the service feeds the tier after every answer of such a mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from decoding.drafter import BaseDrafter, DraftRequest, PromptInfo
from decoding.drafters.racer.cross_session import CrossSessionCache
from decoding.drafters.racer.paths import shared_paths
from decoding.tree import DraftTree


class TierDraft:
    """One request's view of the tier: where the text stands, and the paths the tier knows from there."""

    def __init__(self, shared: CrossSessionCache, prefetch_nodes: int = 8) -> None:
        self.shared = shared
        self.prefetch_nodes = prefetch_nodes
        self._prompt_tail: list[int] = []

    @property
    def prompt_tail(self) -> list[int]:
        """The prompt's last ``context_len`` tokens (an answer is learned with them as leading context)."""
        return self._prompt_tail

    def begin(self, prompt_ids: Sequence[int]) -> None:
        n = self.shared.context_len
        self._prompt_tail = [int(t) for t in prompt_ids[-n:]]
        self.shared.prefetch([self._prompt_tail])  # the context of the first root

    def paths(self, generated: Sequence[int], budget: int) -> DraftTree:
        """Paths below the root (the last of ``generated``) from the continuations of the context before it."""
        tail = self._tail(generated)
        conts = self.shared.continuations(tail[:-1])
        return shared_paths(conts, tail[-1], budget) if conts else DraftTree()

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


class CrossSessionDrafter(BaseDrafter):
    """The tier's paths alone (whole budget), for a mode without RACER. Reads only; one per request."""

    name = "cross_session"

    def __init__(self, shared: CrossSessionCache, prefetch_nodes: int = 8) -> None:
        self.draft = TierDraft(shared, prefetch_nodes)

    def begin(self, prompt: PromptInfo) -> None:
        self.draft.begin(prompt.prompt_ids)

    def propose(self, request: DraftRequest) -> DraftTree:
        if request.budget <= 0 or not request.generated:
            return DraftTree()
        tree = self.draft.paths(request.generated, request.budget)
        self.draft.prefetch_after(request.generated, tree)
        return tree
