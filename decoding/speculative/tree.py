"""Draft trees: tokens + parents, merging with de-duplication, and the layout the verifier needs.

A draft tree hangs below a *root*: the token the target has already decided (the last bonus token),
which is not yet in the KV cache. Node ``i`` has ``parents[i] == -1`` when it is a child of the root,
otherwise ``parents[i] < i``. Order inside a tree is priority order: when a budget cuts a tree, the
first nodes are kept. In the flattened layout the root is row 0 and node ``i`` is row ``i + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1


@dataclass
class DraftTree:
    """Proposed tokens below the root.

    ``probs[i]`` is the drafter's distribution q (a ``[vocab]`` float tensor) from which ``tokens[i]`` was
    *sampled*, or ``None`` for a deterministic draft (n-gram, logits table, top-k alternatives), which the
    sampling verifier treats as a point mass. Both are lossless; q only raises acceptance.

    ``kinds[i]`` is a finer class than the source for acceptance statistics (e.g. a retrieval path under a
    long context, the top-1 of a logits row); the engine learns how often each kind is accepted and sizes
    the verified tree from it (``decoding.speculative.budget``). It defaults to the source.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    probs: list[torch.Tensor | None] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(
        self, parent: int, token: int, source: str, prob: torch.Tensor | None = None, kind: str | None = None
    ) -> int:
        """Append a node and return its index. ``parent`` is ``ROOT`` or an earlier index."""
        if parent != ROOT and not 0 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} out of range for a tree of {len(self.tokens)} nodes")
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.sources.append(source)
        self.probs.append(prob)
        self.kinds.append(kind or source)
        return len(self.tokens) - 1

    def copy(self) -> DraftTree:
        return DraftTree(list(self.tokens), list(self.parents), list(self.sources), list(self.probs), list(self.kinds))

    def subset(self, keep: Sequence[int]) -> DraftTree:
        """The nodes ``keep`` (ascending, each node's parent kept too), re-indexed, order preserved."""
        out = DraftTree()
        new: dict[int, int] = {}
        for i in keep:
            p = self.parents[i]
            if p != ROOT and p not in new:
                raise ValueError(f"node {i} kept without its parent {p}")
            parent = ROOT if p == ROOT else new[p]
            new[i] = out.add(parent, self.tokens[i], self.sources[i], self.probs[i], self.kinds[i])
        return out

    @classmethod
    def chain(
        cls, tokens: Sequence[int], source: str, probs: Sequence[torch.Tensor | None] | None = None
    ) -> DraftTree:
        tree = cls()
        parent = ROOT
        for i, tok in enumerate(tokens):
            parent = tree.add(parent, tok, source, None if probs is None else probs[i])
        return tree

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == ROOT else out[p] + 1)
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (inclusive)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def children(self) -> list[list[int]]:
        """Children lists for the root (index 0) and every node (index i + 1), in priority order."""
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids


def merge_trees(trees: Sequence[DraftTree], budget: int) -> DraftTree:
    """Merge trees in priority order into one, de-duplicating equal paths; ``budget`` counts unique nodes.

    Trees earlier in ``trees`` go first; a node whose path already exists costs nothing, so a later tree
    fills exactly the budget left after merging (not before). A node is dropped when its parent was.

    Only deterministic (point-mass) nodes are folded into an equal existing node. A *sampled* node (one with
    its q) always stays a node of its own: recursive rejection sampling tests a sampled child against its q,
    which is only right if whether the child is there never depends on the token it drew. Folding it into an
    equal sibling would drop it exactly when it drew that token, so the children that remain would be drawn
    from q conditioned on differing, not from q. (A point-mass duplicate may go: after its twin is tested
    the residual either excludes that token or is sampled directly, the same distribution either way.)
    """
    merged = DraftTree()
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> first merged node with that token
    for tree in trees:
        mapping: list[int | None] = []
        for i, tok in enumerate(tree.tokens):
            p = tree.parents[i]
            mp = ROOT if p == ROOT else mapping[p]
            if mp is None:
                mapping.append(None)
                continue
            key = (mp, tok)
            hit = None if tree.probs[i] is not None else index.get(key)
            if hit is None:
                if len(merged) >= budget:
                    mapping.append(None)
                    continue
                hit = merged.add(mp, tok, tree.sources[i], tree.probs[i], tree.kinds[i])
                index.setdefault(key, hit)
            mapping.append(hit)
    return merged


@dataclass(frozen=True)
class TreeLayout:
    """What one verify forward needs. Row 0 is the root; row ``i + 1`` is node ``i``."""

    input_ids: torch.Tensor  # [1, n + 1] long
    position_ids: torch.Tensor  # [1, n + 1] long: start + depth
    ancestor_mask: torch.Tensor  # [n + 1, n + 1] bool: True where row may attend column (ancestors + self)


def tree_layout(root: int, tree: DraftTree, start: int, device: torch.device | str = "cpu") -> TreeLayout:
    """Flatten ``root`` + ``tree`` for a verify pass whose root sits at absolute position ``start``."""
    if not len(tree):  # a plain step: the root alone
        return TreeLayout(input_ids=torch.tensor([[root]], dtype=torch.long, device=device),
                          position_ids=torch.tensor([[start]], dtype=torch.long, device=device),
                          ancestor_mask=torch.ones(1, 1, dtype=torch.bool, device=device))
    n = len(tree) + 1
    tokens = [root, *tree.tokens]
    depths = [0, *tree.depths()]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(tree.parents):
        row = i + 1
        mask[row] = mask[p + 1]
        mask[row, row] = True
    return TreeLayout(
        input_ids=torch.tensor([tokens], dtype=torch.long, device=device),
        position_ids=torch.tensor([[start + d for d in depths]], dtype=torch.long, device=device),
        ancestor_mask=mask.to(device),
    )
