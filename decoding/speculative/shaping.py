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
    columns: torch.Tensor  # sorted token ids always touched (biased or in the prompt)


class LogitShaper:
    """One generation's shaping: ``shape(logits, answer, paths)`` returns the rows' shaped logits (float32)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.frequency = float(params.frequency_penalty)
        self.presence = float(params.presence_penalty)
        self.repetition = float(params.repetition_penalty)
        bias = torch.zeros(vocab, dtype=torch.float32)
        biased = torch.zeros(vocab, dtype=torch.bool)
        for token, value in params.logit_bias:
            bias[token], biased[token] = value, True
        in_prompt = torch.zeros(vocab, dtype=torch.bool)
        if self.repetition != 1.0 and len(prompt_ids):
            in_prompt[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        columns = torch.nonzero(biased | in_prompt).flatten()
        self._fixed = _Fixed(bias.to(device), biased.to(device), in_prompt.to(device), columns.to(device))
        self.device = device

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return bool(params.logit_bias) or params.repetition_penalty != 1.0 or bool(
            params.frequency_penalty or params.presence_penalty)

    def shape(self, logits: torch.Tensor, answer: Sequence[int], paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """``logits`` ``[rows, vocab]``; row r continues ``answer`` with ``paths[r]``. A new float32 tensor."""
        out = logits.float().clone()
        fixed = self._fixed
        answer_t = torch.as_tensor(list(answer), dtype=torch.long)
        path_rows = torch.as_tensor([r for r, p in enumerate(paths) for _ in p], dtype=torch.long)
        path_tokens = torch.as_tensor([t for p in paths for t in p], dtype=torch.long)
        dynamic = torch.cat([answer_t, path_tokens]).to(self.device)
        columns = torch.unique(torch.cat([fixed.columns, dynamic]))  # sorted
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
        out[:, columns] = self._penalize(out[:, columns], columns, counts)
        return out

    def _penalize(self, v: torch.Tensor, columns: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The shaped values of ``v`` (``[rows, len(columns)]``) given each cell's count on its row's path."""
        fixed = self._fixed
        v = torch.where(fixed.biased[columns], v + fixed.bias[columns], v)
        seen = counts > 0
        if self.repetition != 1.0:
            hit = seen | fixed.in_prompt[columns]
            v = torch.where(hit, torch.where(v > 0, v / self.repetition, v * self.repetition), v)
        if self.frequency or self.presence:
            v = torch.where(seen, v - (counts * self.frequency + self.presence), v)
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
