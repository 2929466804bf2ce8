"""RACER's draft paths as pure functions: logits paths and shared-tier paths (the retrieval path is a suffix
match's chain: ``decoding.drafters.suffix.SuffixDrafter``).

Each returns a ``DraftTree`` below the root (the root itself is not a node), nodes in priority order,
labelled with a stable source name so the engine's stats show each source's share.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from decoding.drafters.racer.logits_table import LogitsTable
from decoding.speculative.tree import ROOT, DraftTree

SOURCE_RETRIEVAL = "racer.retrieval"
SOURCE_LOGITS = "racer.logits"
SOURCE_CROSS_SESSION = "racer.cross_session"



def logits_paths(
    table: LogitsTable, root: int, budget: int, breadth: int = 8, source: str = SOURCE_LOGITS,
    into: DraftTree | None = None,
) -> DraftTree:
    """Breadth-first through the logit cues from ``root``: a node's candidates are the target's top-k after
    its token (the ``table``).

    A node of breadth b proposes its first b candidates; its j-th child (0-based) gets breadth
    max(1, b >> (j + 1)). The root has breadth ``breadth``. A node's kind names its rank
    (``racer.logits/r0`` ...), so the budget policy learns each one's acceptance. Stops when the tree holds
    ``budget`` nodes. With ``into``, the paths are merged into a copy of that tree: a path already there
    costs nothing and the search goes on below the existing node, so the budget counts unique nodes (the
    result equals ``merge_trees([into, logits tree], budget)``).
    """
    tree = DraftTree()
    index: dict[tuple[int, int], int] = {}
    if into is not None:
        tree = into.copy()
        index = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True))}
    level: list[tuple[int, int, int]] = [(ROOT, root, breadth)]  # (tree node, its token, breadth)
    next_tokens = table.next_tokens
    while level and len(tree) < budget:
        below: list[tuple[int, int, int]] = []
        for parent, token, b in level:
            for j, nxt in enumerate(next_tokens(token, b)):
                node = index.get((parent, nxt))
                if node is None:
                    if len(tree) >= budget:
                        break
                    node = tree.add(parent, nxt, source, kind=f"{source}/r{min(j, 3)}")
                    index[(parent, nxt)] = node
                below.append((node, nxt, max(1, b >> (j + 1))))
        level = below
    return tree


def shared_paths(
    continuations: Sequence[tuple[Sequence[int], float]], root: int, budget: int,
    source: str = SOURCE_CROSS_SESSION, kind: str | None = None,
) -> DraftTree:
    """A tree from the shared tier's continuations of the context before the root.

    Only continuations whose first token is ``root`` apply; their remaining tokens form a trie whose node
    weight is the summed score of the continuations through it. Nodes are taken best weight first; every
    node has ``kind`` (default: the source).
    """
    tree = DraftTree()
    if budget <= 0:
        return tree
    weight: dict[tuple[int, ...], float] = {}
    for cont, score in continuations:
        if len(cont) < 2 or cont[0] != root or score <= 0:
            continue
        for j in range(2, len(cont) + 1):
            key = tuple(cont[1:j])
            weight[key] = weight.get(key, 0.0) + float(score)
    if not weight:
        return tree
    kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for key in weight:
        kids.setdefault(key[:-1], []).append(key)
    heap: list[tuple[float, tuple[int, ...], int]] = [(-weight[k], k, ROOT) for k in kids.get((), [])]
    heapq.heapify(heap)
    while heap and len(tree) < budget:
        _, key, parent = heapq.heappop(heap)
        index = tree.add(parent, key[-1], source, kind=kind)
        for k in kids.get(key, []):
            heapq.heappush(heap, (-weight[k], k, index))
    return tree
