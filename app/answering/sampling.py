"""Both APIs' sampling fields -> the engine's ``SamplingParams`` (with the server's default penalties)."""

from __future__ import annotations

from app.config import PenaltyDefaults
from app.errors import InvalidRequest
from app.schemas import LogitControls
from decoding.speculative.generation import SamplingParams


def sampling_params(body: LogitControls, defaults: PenaltyDefaults, vocab: int, *, temperature: float,
                    top_p: float, seed: int | None, eta: float = 0.0) -> SamplingParams:
    """The request's sampling: its own penalties, else the server's defaults (422 for a biased token outside the
    model's vocabulary)."""
    bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
    outside = [t for t, _ in bias if t >= vocab]
    if outside:
        raise InvalidRequest(f"logit_bias: token {outside[0]} is not in the model's vocabulary (ids 0-{vocab - 1})")
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(0, body.top_k), seed=seed, eta=eta, min_p=body.min_p,
        frequency_penalty=defaults.frequency if body.frequency_penalty is None else body.frequency_penalty,
        presence_penalty=defaults.presence if body.presence_penalty is None else body.presence_penalty,
        repetition_penalty=defaults.repetition if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias,
    )


def logprobs_asked(body: LogitControls) -> int | None:
    """How many alternatives per token the request wants with its log-probabilities (None: none wanted)."""
    return (body.top_logprobs or 0) if body.logprobs else None
