"""Verification of a draft tree against the target's logits: pure functions over tensors.

Rows follow ``decoding.speculative.tree.tree_layout``: row 0 is the root, row ``i + 1`` is node ``i``; ``logits[r]``
is the target's prediction for the token *after* row r.

Words, defined once:
- **accepted**: draft nodes on the path the target agrees with (greedy: equal to its argmax; sampling:
  passed the rejection test).
- **bonus**: the token the target itself emits after the last accepted node (greedy: its argmax;
  sampling: a sample from p at a leaf, or the **recovered** token drawn from the residual distribution
  after every child of the last accepted node was rejected). It becomes the next step's root.

Sampling (temperature > 0) uses multi-draft recursive rejection sampling (SpecInfer): at a node with
target distribution p, children are tried in order. A child sampled from the drafter's q is accepted with
probability min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)). A deterministic child (no q) is a
point mass: accepted with probability p(x); on rejection p(x) <- 0 and p is renormalised. Either rule
leaves the emitted token distributed exactly as p, so the output distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.speculative.generation import SamplingParams
from decoding.speculative.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: list[int]  # node indices (root excluded), in path order
    bonus: int  # the target's own next token after the accepted path


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Longest path whose every token equals the target's argmax, plus the bonus token.

    ``logits``: ``[n + 1, vocab]`` for the root and every node.
    """
    return greedy_path(tree, logits.argmax(dim=-1).tolist())


def greedy_path(tree: DraftTree, target: Sequence[int]) -> Verdict:
    """``verify_greedy`` given the target's token after every row (``target[r]``, ``n + 1`` of them): the
    engine computes them on the device and brings them to the host with the rest of the step's results."""
    kids = tree.children()
    row, accepted = 0, list[int]()
    while True:
        want = int(target[row])
        nxt = next((c for c in kids[row] if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(accepted, want)
        accepted.append(nxt)
        row = nxt + 1


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution p the target samples from: temperature, then top-k, then min-p, then top-p (nucleus).

    ``logits``: ``[..., vocab]`` (already shaped: ``decoding.speculative.shaping``); returns float32
    probabilities of the same shape.
    """
    z = logits.float() / max(params.temperature, 1e-6)
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if params.min_p > 0.0:
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        cut = before >= params.top_p
        cut[..., 0] = False  # the most likely token always stays (a top_p that rounds to 0 keeps just it)
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator).item())


def transfer(p: torch.Tensor, q: torch.Tensor, eta: float, floor: float = 0.1) -> torch.Tensor:
    """RAPID's knowledge transfer: p_hat = softmax(log p + eta (q - p)), the shift applied only where the
    drafter is fairly sure (q >= floor * max q). Not lossless: p_hat is not the target's distribution."""
    shift = torch.where(q >= floor * q.max(), eta * (q - p), torch.zeros_like(p))
    return torch.softmax(torch.log(p) + shift, dim=-1)


def one_step_output(p: torch.Tensor, q: torch.Tensor, eta: float) -> torch.Tensor:
    """The emitted token's distribution after one drafted token x ~ q under the eta rule (rows: positions):
    what ``verify_sampling`` emits in distribution (exactly p at eta = 0)."""
    p_hat = torch.stack([transfer(pi, qi, eta) for pi, qi in zip(p, q, strict=True)]) if eta else p
    a = torch.where(q > 0, torch.clamp(p_hat / q, max=1.0), torch.zeros_like(q))
    accepted = q * a
    residual = torch.clamp(torch.maximum(p - p_hat, p - q), min=0.0)
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return accepted + (1.0 - accepted.sum(dim=-1, keepdim=True)) * residual


def verify_sampling(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None, eta: float = 0.0
) -> Verdict:
    """Multi-draft recursive rejection sampling over a tree (lossless for any drafts).

    ``probs``: ``[n + 1, vocab]`` target distributions p (already tempered / truncated) for every row, on the
    ``generator``'s device (the engine passes host rows and a CPU generator: a draw per tried child, so on the
    host these draws cost no device round trip).
    ``eta`` > 0 (opt-in, NOT lossless): a sampled child x ~ q is accepted with min(1, p_hat(x) / q(x)),
    p_hat = ``transfer(p, q, eta)``, and a rejection leaves norm(max(p - p_hat, p - q, 0)); the bonus token
    still comes from plain p.
    """
    kids = tree.children()
    row, accepted = 0, list[int]()
    while True:
        p = probs[row].clone()
        moved = False
        for child in kids[row]:
            x = tree.tokens[child]
            q = tree.probs[child]
            if q is None:  # point mass at x
                if _uniform(generator) < float(p[x]):
                    moved = True
                else:
                    p[x] = 0.0
            elif eta > 0.0:
                qd = q.to(p.dtype)
                p_hat = transfer(p, qd, eta)
                qx = float(qd[x])
                if qx > 0 and _uniform(generator) < min(1.0, float(p_hat[x]) / qx):
                    moved = True
                else:
                    p = torch.clamp(torch.maximum(p - p_hat, p - qd), min=0.0)
            else:
                qx = float(q[x])
                if qx > 0 and _uniform(generator) < min(1.0, float(p[x]) / qx):
                    moved = True
                else:
                    p = torch.clamp(p - q.to(p.dtype), min=0.0)
            if moved:
                accepted.append(child)
                row = child + 1
                break
            total = float(p.sum())
            if total <= 0.0:  # numerically exhausted: fall back to the untouched target row
                p = probs[row].clone()
                break
            p = p / total
        if not moved:
            return Verdict(accepted, _sample(p, generator))
