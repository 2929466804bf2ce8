"""The RACER drafter: retrieval paths + logits paths (+ the cross-session tier) merged into one draft tree.

Per step (``propose``), below the root (the target's already decided next token):

1. cross-session paths (``tier_drafter``): continuations that followed the same context in this
   tenant's earlier answers. They only exist where the answer retraces an earlier one (a repeated
   question), and there they are the best drafts, so they come first;
2. the retrieval path: what followed the most recent occurrence of the longest suffix of prompt + output
   (root included), an exact match kept incrementally (``decoding.drafters.suffix.SuffixIndex``), as one chain
   whose nodes are labelled with the match length they stand on (``racer.retrieval/m3``...): a long match of
   the document is likely to go on, a one-token one rarely;
3. logits paths: breadth-first through the logits table from the root (the target's top-k after each
   token, learned from this prompt's prefill and every verified node), filling the rest.

The trees are merged in that priority order (``merge_trees``, then the logits search runs *into* the
merged tree), so the budget counts *unique* nodes after de-duplication and the logits part fills
exactly what is left. Nodes are labelled ``racer.retrieval``, ``racer.cross_session`` and
``racer.logits`` (a node found by several keeps the first label), so the engine's per-source stats show
each part's share. (RACER's n-gram automaton, a trie of every window of up to 10 tokens with suffix links,
ranked several contexts' continuations by count; the exact longest match drafted as well or better at a
fraction of the host time and memory, so it replaced it.)

``observe`` writes the target's top-k after the root and after every verified node (rejected ones too)
into the logits table. ``end`` sends the answer's n-grams to the shared tier (in the background).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from decoding.drafters.racer.cross_session import CrossSessionCache, SharedTier
from decoding.drafters.racer.logits_table import LogitsTable
from decoding.drafters.racer.paths import SOURCE_RETRIEVAL, logits_paths
from decoding.drafters.racer.tier_drafter import TierDraft
from decoding.drafters.suffix import SuffixDrafter, suffix_priors
from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.tree import DraftTree, merge_trees

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RacerConfig:
    max_match: int = 64  # longest suffix match the retrieval path looks for
    max_retrieval: int = 24  # longest retrieval chain
    topk: int = 8  # breadth of the root in the logits paths (<= the table's k)
    cross_session_prefetch: int = 8  # tree nodes whose next-step contexts are prefetched from the shared tier

    def __post_init__(self) -> None:
        if self.max_match < 1 or self.max_retrieval < 1 or self.topk < 1:
            raise ValueError("max_match, max_retrieval and topk must be >= 1")


class RacerDrafter(BaseDrafter):
    """RACER as a ``Drafter``: one instance per request (cheap); the table and caches are shared."""

    name = "racer"
    uses_node_topk = True  # its logit-cue table learns the target's top-k at every verified row
    priors = suffix_priors(SOURCE_RETRIEVAL)

    def __init__(self, config: RacerConfig, logits_table: LogitsTable, shared: CrossSessionCache | None = None) -> None:
        self.config = config
        self.table = logits_table
        self.shared = shared
        self.reset()

    # ---- Drafter protocol --------------------------------------------------------------------------

    def reset(self) -> None:
        cfg = self.config
        self.retrieval = SuffixDrafter(None, cfg.max_retrieval, cfg.max_match, source=SOURCE_RETRIEVAL)
        self.tier = TierDraft(self.shared, cfg.cross_session_prefetch) if self.shared is not None else None

    def begin(self, prompt: PromptInfo) -> None:
        self.reset()
        ids = list(prompt.prompt_ids)
        self.retrieval.begin(prompt)
        if prompt.prompt_topk is not None:
            self.table.update(ids, prompt.prompt_topk)
        if self.tier is not None:
            self.tier.begin(ids)

    def propose(self, request: DraftRequest) -> DraftTree:
        retrieval = self.retrieval.propose(request)  # kept in step with the output even when the budget is 0
        budget = request.budget
        if budget <= 0:
            return DraftTree()
        trees = []
        if self.tier is not None:
            shared = self.tier.paths(request.generated, budget)
            if len(shared):
                trees.append(shared)
        trees.append(retrieval)
        head = trees[0] if len(trees) == 1 else merge_trees(trees, budget)
        # logits paths fill what is left after de-duplication (a path already proposed costs nothing)
        merged = logits_paths(self.table, int(request.root), budget, self.config.topk, into=head)
        if self.tier is not None:
            self.tier.prefetch_after(request.generated, merged)
        return merged

    def observe(self, outcome: VerifyOutcome) -> None:
        if outcome.node_topk is not None:
            self.table.update([int(outcome.root), *outcome.tree.tokens], outcome.node_topk)

    def end(self, output_ids: Sequence[int]) -> None:
        if self.tier is not None:
            self.tier.learn(output_ids)


class RacerFactory:
    """Process-wide RACER state for one target model; ``drafter(tenant)`` makes a request's drafter.

    Holds the logits table (per model) and the shared tier (Redis or in-process); the shared tier is keyed per
    tenant through ``CrossSessionCache``.
    """

    def __init__(
        self,
        config: RacerConfig,
        logits_table: LogitsTable,
        shared_tier: SharedTier | None = None,
        *,
        model_id: str = "",
        tokenizer_hash: str = "",
    ) -> None:
        self.config = config
        self.table = logits_table
        self.shared_tier = shared_tier
        self.model_id = model_id or logits_table.model_id
        self.tokenizer_hash = tokenizer_hash

    def drafter(self, tenant: str = "") -> RacerDrafter:
        shared = None
        if self.shared_tier is not None:
            shared = self.shared_tier.cache(self.model_id, self.tokenizer_hash, tenant)
        return RacerDrafter(self.config, self.table, shared)

    def tier_cache(self, tenant: str = "") -> CrossSessionCache | None:
        """``tenant``'s handle on the shared tier (None without a tier)."""
        if self.shared_tier is None:
            return None
        return self.shared_tier.cache(self.model_id, self.tokenizer_hash, tenant)

    def close(self) -> None:
        if self.shared_tier is not None:
            self.shared_tier.close()
