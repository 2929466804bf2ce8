"""Bulk construction of an n-gram automaton's columns from a whole prompt, with numpy.

Equivalent to feeding the tokens one by one (same node ids up to order, counts, stamps and suffix links),
but one ``np.unique`` per window length instead of a Python loop per token: window strings of length d
are keyed by (id of their first d - 1 tokens, last token); the latest occurrence of each string gives
its stamp, its parent is the id of its prefix and its suffix link the id of the window one token later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NONE = -1


@dataclass(frozen=True)
class Columns:
    """One entry per node (root first), as ``NgramAutomaton`` stores them."""

    token: np.ndarray
    parent: np.ndarray
    link: np.ndarray
    depth: np.ndarray
    count: np.ndarray
    stamp: np.ndarray
    refs: np.ndarray  # children + incoming suffix links
    first: np.ndarray  # first child
    next: np.ndarray  # next sibling
    prev: np.ndarray  # previous sibling
    cur: int  # node of the longest suffix of the text of length <= max_ngram - 1


def bulk_columns(text: np.ndarray, max_ngram: int, stride: int) -> Columns:
    """The columns of the automaton of ``text`` (int64, non-empty); edge keys are ``parent * stride + token``."""
    n = int(text.size)
    toks, parents, links = [np.array([NONE])], [np.array([NONE])], [np.array([NONE])]
    depths, counts, stamps = [np.array([0])], [np.array([0])], [np.array([-1])]
    offset = 1
    prev_ids = np.zeros(n + 1, dtype=np.int64)  # level 0: every window is the root
    cur = 0
    cur_len = min(n, max_ngram - 1)
    for d in range(1, min(max_ngram, n) + 1):
        m = n - d + 1  # windows text[i : i + d], i < m
        last_tok = text[d - 1 :]
        key = prev_ids[:m] * stride + last_tok
        # unique over the reversed windows: the first index found is the latest occurrence
        uniq, first_rev, inverse_rev, cnt = np.unique(
            key[::-1], return_index=True, return_inverse=True, return_counts=True)
        inverse = inverse_rev.reshape(-1)[::-1]
        u = int(uniq.size)
        rep = (m - 1) - first_rev  # start of the latest occurrence of each string
        toks.append(last_tok[rep])
        parents.append(prev_ids[rep])
        links.append(prev_ids[rep + 1])
        depths.append(np.full(u, d, dtype=np.int64))
        counts.append(cnt)
        stamps.append(rep + d - 1)  # the end of its latest occurrence
        ids = offset + inverse
        if d == cur_len:
            cur = int(ids[n - d])
        prev_ids = ids
        offset += u
    tok = np.concatenate(toks)
    par = np.concatenate(parents)
    lnk = np.concatenate(links)
    size = offset
    refs = np.bincount(par[1:], minlength=size) + np.bincount(lnk[1:], minlength=size)
    first = np.full(size, NONE, dtype=np.int64)
    nxt = np.full(size, NONE, dtype=np.int64)
    prv = np.full(size, NONE, dtype=np.int64)
    order = np.argsort(par[1:], kind="stable") + 1
    sp = par[order]
    same = sp[1:] == sp[:-1]
    nxt[order[:-1]] = np.where(same, order[1:], NONE)
    prv[order[1:]] = np.where(same, order[:-1], NONE)
    heads = np.concatenate([[True], ~same])
    first[sp[heads]] = order[heads]
    return Columns(tok, par, lnk, np.concatenate(depths), np.concatenate(counts), np.concatenate(stamps),
                   refs, first, nxt, prv, cur)
