"""Seeded sampling that does not depend on drafting: Gumbel-max coupling per output position.

With a seed, the token at output position t is ``argmax(log p_t + g_t)`` where ``g_t`` is Gumbel noise drawn
from a generator seeded by (seed, t) alone. That is an exact sample from the target's p_t (the Gumbel-max
trick), and it is a pure function of (seed, position, p_t): a draft node is accepted when its token equals
the coupled sample at its position, which makes verification greedy on the perturbed scores. So a seeded
request gives the same answer whatever the drafters proposed and whatever the budget policy verified, and
the same as plain decoding with that seed; unseeded sampling keeps recursive rejection sampling
(``decoding.speculative.verify.verify_sampling``).
"""

from __future__ import annotations

import hashlib

import torch

from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import Verdict, verify_greedy


class SeededNoise:
    """Gumbel noise ``[vocab]`` for each output position, a pure function of (seed, position)."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed = int(seed)
        self.vocab = vocab
        self._cache: dict[int, torch.Tensor] = {}

    def at(self, position: int) -> torch.Tensor:
        g = self._cache.get(position)
        if g is None:
            digest = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
            u = torch.rand(self.vocab, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
            g = -torch.log(-torch.log(u))
            self._cache[position] = g
            self._cache.pop(position - 64, None)  # positions far behind the output are never asked again
        return g

    def scores(self, probs: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """``log p + g`` per row (``probs`` ``[rows, vocab]``, row r at output position ``positions[r]``)."""
        noise = torch.stack([self.at(t) for t in positions]).to(probs.device)
        return torch.log(probs.double()) + noise


def verify_coupled(tree: DraftTree, probs: torch.Tensor, noise: SeededNoise, first_position: int) -> Verdict:
    """Accept draft nodes equal to the coupled sample at their position; the bonus is the next one.

    ``probs``: ``[n + 1, vocab]`` (root row first); row r predicts output position ``first_position +
    depth(r)`` (the root has depth 0).
    """
    positions = [first_position, *(first_position + d for d in tree.depths())]
    return verify_greedy(tree, noise.scores(probs, positions))
