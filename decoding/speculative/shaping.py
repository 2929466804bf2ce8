"""The request's logit shaping (logit bias, repetition / frequency / presence penalties) and log-probabilities,
applied to every verified row with that row's own context.

A penalty depends on the tokens generated so far, so in a draft tree each row's target distribution depends
on its path: the row of node ``i`` continues the answer with the tokens from the root's child down to ``i``.
``LogitShaper`` applies the penalties of ``answer + path`` to each row. Every touched logit is one elementwise
function of (its raw value, the token's count on that row's path, whether the prompt holds it), computed the same
way whether the row is verified alone or among others, so speculative output equals plain decoding with the
same parameters (greedy token for token, sampling in distribution, seeded sampling identically).

Semantics (those of OpenAI and vLLM), in this order:
- ``logit_bias``: added to the raw logit of each listed token.
- ``repetition_penalty`` r (the multiplicative form of HF / vLLM): a token present in the prompt or in the answer
  so far has its logit divided by r when positive, multiplied by r otherwise.
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): a token generated c > 0 times so far loses
  ``c f + p``. They count the answer only, never the prompt (a RAG answer should copy from its document).

Log-probabilities are those of the shaped logits (after bias and penalties, before temperature and truncation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.runtime import host
from decoding.speculative.generation import SamplingParams, TokenLogprob
from decoding.speculative.tree import ROOT, DraftTree

SORT_BELOW = 1024  # fewer always-shaped tokens than this: a step sorts them with its own instead of a vocabulary mask


def row_paths(tree: DraftTree) -> list[list[int]]:
    """The tokens each verified row adds to the answer: row 0 (the root) none, row ``i + 1`` the tokens from the
    root's child down to node ``i``."""
    paths: list[list[int]] = [[]]
    for i, parent in enumerate(tree.parents):
        paths.append([*paths[0 if parent == ROOT else parent + 1], tree.tokens[i]])
    return paths


@dataclass(frozen=True)
class _Fixed:
    """What a generation's shaping needs that no step changes, on the logits' device."""

    bias: torch.Tensor  # [vocab] float32, 0 where no bias
    biased: torch.Tensor  # [vocab] bool
    in_prompt: torch.Tensor  # [vocab] bool (the repetition penalty's prompt tokens; all False when it is off)
    touched: torch.Tensor  # [vocab] bool: always shaped (biased or in the prompt)
    columns: torch.Tensor  # the same as sorted token ids


class LogitShaper:
    """One generation's shaping: ``shape_(logits, answer, paths)`` shapes each row with its own path."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.frequency = float(params.frequency_penalty)
        self.presence = float(params.presence_penalty)
        self.repetition = float(params.repetition_penalty)
        self.biased = bool(params.logit_bias)
        bias = torch.zeros(vocab, dtype=torch.float32)
        biased = torch.zeros(vocab, dtype=torch.bool)
        for token, value in params.logit_bias:
            bias[token], biased[token] = value, True
        in_prompt = torch.zeros(vocab, dtype=torch.bool)
        if self.repetition != 1.0 and len(prompt_ids):
            in_prompt[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        touched = biased | in_prompt
        self._fixed = _Fixed(*(t.to(device) for t in (bias, biased, in_prompt, touched, torch.nonzero(touched)[:, 0])))
        self.device = device

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return bool(params.logit_bias) or params.repetition_penalty != 1.0 or bool(
            params.frequency_penalty or params.presence_penalty)

    def shape_(self, logits: torch.Tensor, answer: Sequence[int], paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """``logits`` ``[rows, vocab]`` shaped, row r continuing ``answer`` with ``paths[r]``: in place when they
        are float32 (the engine's logits of one forward, read by nothing else), else a float32 copy. Only the
        columns of tokens that are biased, in the prompt or on some row's path are read and written."""
        out = logits.float()
        fixed = self._fixed
        answer_t = torch.as_tensor(list(answer), dtype=torch.long)
        path_rows = torch.as_tensor([r for r, p in enumerate(paths) for _ in p], dtype=torch.long)
        path_tokens = torch.as_tensor([t for p in paths for t in p], dtype=torch.long)
        dynamic = torch.cat([answer_t, path_tokens]).to(self.device)
        if len(fixed.columns) < SORT_BELOW:
            columns = torch.unique(torch.cat([fixed.columns, dynamic]))  # sorted
        else:  # a whole prompt's tokens: marking them in a vocabulary mask is cheaper than sorting them each step
            touched = fixed.touched.clone()
            touched[dynamic] = True
            columns = torch.nonzero(touched).flatten()
        if not len(columns):
            return out
        counts = torch.zeros(len(paths), len(columns), dtype=torch.float32, device=self.device)
        if len(answer_t):
            counts += torch.bincount(torch.searchsorted(columns, answer_t.to(self.device)),
                                     minlength=len(columns)).float()
        if len(path_tokens):
            at = torch.searchsorted(columns, path_tokens.to(self.device))
            counts.index_put_((path_rows.to(self.device), at), torch.ones_like(at, dtype=torch.float32),
                              accumulate=True)
        return out.index_copy_(1, columns, self._penalize(out.index_select(1, columns), columns, counts))

    def _penalize(self, v: torch.Tensor, columns: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The shaped values of ``v`` (``[rows, len(columns)]``) given each cell's count on its row's path.

        A cell the request does not touch gets ``+ 0`` or ``- 0``: its value, up to the sign of a zero (which no
        argmax, softmax or log-probability sees), so masks are needed only by the repetition penalty."""
        fixed = self._fixed
        if self.biased:
            v = v + fixed.bias.index_select(0, columns)
        seen = counts.clamp(max=1.0)  # 1.0 where the row's path holds the token
        if self.repetition != 1.0:  # every row holds the prompt's tokens: a mask only for the others' columns
            r = self.repetition
            rep = v.clamp(min=0) / r + v.clamp(max=0) * r
            other = torch.nonzero(~fixed.in_prompt.index_select(0, columns))[:, 0]
            if len(other):
                held = seen.index_select(1, other) > 0
                rep.index_copy_(1, other, torch.where(held, rep.index_select(1, other), v.index_select(1, other)))
            v = rep
        if self.frequency or self.presence:
            v = v - (counts * self.frequency + seen * self.presence)
        return v


def token_logprobs(shaped: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each row's emitted token's log-probability and the ``top`` most likely tokens' (``shaped`` ``[rows, vocab]``,
    one row per token in ``tokens``)."""
    logp = torch.log_softmax(shaped.float(), dim=-1)
    chosen = logp.gather(1, torch.as_tensor(list(tokens), device=logp.device)[:, None])[:, 0]
    if top:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
    else:
        values = ids = torch.zeros(len(tokens), 0, device=logp.device)
    chosen_h, values_h, ids_h = host.fetch(chosen, values, ids)
    return [
        TokenLogprob(int(tok), float(chosen_h[r]),
                     tuple((int(i), float(v)) for i, v in zip(ids_h[r].tolist(), values_h[r].tolist(), strict=True)))
        for r, tok in enumerate(tokens)
    ]
