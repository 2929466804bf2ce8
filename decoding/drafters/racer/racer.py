"""The RACER drafter: retrieval paths + logits paths (+ the cross-session tier) merged into one draft tree.

Per step (``propose``), below the root (the target's already decided next token):

1. cross-session paths (``tier_drafter``): continuations that followed the same context in this
   tenant's earlier answers. They only exist where the answer retraces an earlier one (a repeated
   question), and there they are the best drafts, so they come first;
2. retrieval paths from this request's n-gram automaton (prompt + output, root included), longest
   matched contexts first, then counts; paths found under a long (strong) context may take the whole
   budget, those from short contexts at most ``retrieval_share`` of it;
3. logits paths: breadth-first through the logits table from the root (the target's top-k after each
   token, learned from this prompt's prefill and every verified node), filling the rest.

The trees are merged in that priority order (``merge_trees``, then the logits search runs *into* the
merged tree), so the budget counts *unique* nodes after de-duplication and the logits part fills
exactly what is left. Nodes are labelled ``racer.retrieval``, ``racer.cross_session`` and
``racer.logits`` (a node found by several keeps the first label), so the engine's per-source stats show
each part's share.

``observe`` writes the target's top-k after the root and after every verified node (rejected ones too)
into the logits table. The automaton is kept in step with the output at each ``propose`` (the engine's
``generated`` is the truth). ``end`` sends the answer's n-grams to the shared tier (in the background).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from decoding.drafters.racer.automaton import NgramAutomaton
from decoding.drafters.racer.cross_session import CrossSessionCache, SharedTier
from decoding.drafters.racer.logits_table import LogitsTable
from decoding.drafters.racer.paths import logits_paths, retrieval_paths
from decoding.drafters.racer.snapshots import AutomatonCache
from decoding.drafters.racer.tier_drafter import CrossSessionDrafter, TierDraft
from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.tree import DraftTree, merge_trees

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RacerConfig:
    max_ngram: int = 10  # longest window in the automaton
    max_nodes: int = 262_144  # node bound of one request's automaton (~10 MB; an 8K prompt needs ~60K)
    topk: int = 8  # breadth of the root in the logits paths (<= the table's k)
    min_context: int = 2  # shortest matched context (root included) that may propose retrieval paths
    retrieval_share: float = 0.5  # most of the budget retrieval paths from short (weak) contexts may take
    retrieval_strong_context: int = 4  # contexts this long (root included) may take the whole budget
    cross_session_prefetch: int = 8  # tree nodes whose next-step contexts are prefetched from the shared tier

    def __post_init__(self) -> None:
        if self.max_ngram < 2:
            raise ValueError("max_ngram must be >= 2")
        if self.topk < 1 or self.retrieval_strong_context < 1:
            raise ValueError("topk and retrieval_strong_context must be >= 1")
        if not 1 <= self.min_context <= self.max_ngram - 1:
            raise ValueError("min_context must be in [1, max_ngram - 1]")
        if not 0.0 <= self.retrieval_share <= 1.0:
            raise ValueError("retrieval_share must be in [0, 1]")
        NgramAutomaton(self.max_ngram, self.max_nodes)  # validates the bound


class RacerDrafter(BaseDrafter):
    """RACER as a ``Drafter``: one instance per request (cheap); the table and caches are shared."""

    name = "racer"
    uses_node_topk = True  # its logit-cue table learns the target's top-k at every verified row

    def __init__(
        self,
        config: RacerConfig,
        logits_table: LogitsTable,
        shared: CrossSessionCache | None = None,
        *,
        automata: AutomatonCache | None = None,
    ) -> None:
        self.config = config
        self.table = logits_table
        self.shared = shared
        self.automata = automata
        self.reset()

    # ---- Drafter protocol --------------------------------------------------------------------------

    def reset(self) -> None:
        self.automaton: NgramAutomaton | None = None
        self._fed = 0  # generated tokens already fed to the automaton
        self.tier = TierDraft(self.shared, self.config.cross_session_prefetch) if self.shared is not None else None

    def begin(self, prompt: PromptInfo) -> None:
        self.reset()
        cfg = self.config
        ids = list(prompt.prompt_ids)
        if self.automata is not None:
            scope = self.shared.namespace.tag if self.shared is not None else ""
            self.automaton = self.automata.automaton(
                ids, max_ngram=cfg.max_ngram, max_nodes=cfg.max_nodes, scope=scope
            )
        else:
            self.automaton = NgramAutomaton.build(ids, cfg.max_ngram, cfg.max_nodes)
        if prompt.prompt_topk is not None:
            self.table.update(ids, prompt.prompt_topk)
        if self.tier is not None:
            self.tier.begin(ids)

    def propose(self, request: DraftRequest) -> DraftTree:
        auto = self._sync(request.generated)
        budget = request.budget
        if budget <= 0:
            return DraftTree()
        cfg = self.config
        root = int(request.root)
        trees = []
        if self.tier is not None:
            shared = self.tier.paths(request.generated, budget)
            if len(shared):
                trees.append(shared)
        r_cap = min(budget, math.ceil(budget * cfg.retrieval_share))
        trees.append(retrieval_paths(auto, budget, cfg.min_context, weak_budget=r_cap,
                                     strong_context=cfg.retrieval_strong_context))
        head = trees[0] if len(trees) == 1 else merge_trees(trees, budget)
        # logits paths fill what is left after de-duplication (a path already proposed costs nothing)
        merged = logits_paths(self.table, root, budget, cfg.topk, into=head)
        if self.tier is not None:
            self.tier.prefetch_after(request.generated, merged)
        return merged

    def observe(self, outcome: VerifyOutcome) -> None:
        if outcome.node_topk is not None:
            self.table.update([int(outcome.root), *outcome.tree.tokens], outcome.node_topk)

    def end(self, output_ids: Sequence[int]) -> None:
        if self.tier is not None:
            self.tier.learn(output_ids)

    def _sync(self, generated: Sequence[int]) -> NgramAutomaton:
        if self.automaton is None:  # propose without begin: an automaton of the output only
            cfg = self.config
            self.automaton = NgramAutomaton(cfg.max_ngram, cfg.max_nodes)
        if len(generated) > self._fed:
            self.automaton.extend(generated[self._fed :])
            self._fed = len(generated)
        return self.automaton


class RacerFactory:
    """Process-wide RACER state for one target model; ``drafter(tenant)`` makes a request's drafter.

    Holds the logits table (per model), the prompt-automaton snapshots and the shared tier (Redis or
    in-process); the shared tier is keyed per tenant through ``CrossSessionCache``.
    """

    def __init__(
        self,
        config: RacerConfig,
        logits_table: LogitsTable,
        shared_tier: SharedTier | None = None,
        *,
        model_id: str = "",
        tokenizer_hash: str = "",
        automata: AutomatonCache | None = None,
    ) -> None:
        self.config = config
        self.table = logits_table
        self.shared_tier = shared_tier
        self.model_id = model_id or logits_table.model_id
        self.tokenizer_hash = tokenizer_hash
        self.automata = automata if automata is not None else AutomatonCache()

    def drafter(self, tenant: str = "") -> RacerDrafter:
        shared = None
        if self.shared_tier is not None:
            shared = self.shared_tier.cache(self.model_id, self.tokenizer_hash, tenant)
        return RacerDrafter(self.config, self.table, shared, automata=self.automata)

    def cross_session_drafter(self, tenant: str = "") -> CrossSessionDrafter | None:
        """The tier's paths alone for ``tenant`` (a mode without RACER); None without a tier."""
        if self.shared_tier is None:
            return None
        shared = self.shared_tier.cache(self.model_id, self.tokenizer_hash, tenant)
        return CrossSessionDrafter(shared, self.config.cross_session_prefetch)

    def close(self) -> None:
        if self.shared_tier is not None:
            self.shared_tier.close()
