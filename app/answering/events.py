"""What one answer tells the API that asked: ``Sources`` once retrieved, ``Waiting`` / ``Prefill`` progress
before the first token, ``Token``s as the text becomes final (a reasoning model's ``Reasoning`` beside them, which an
API that has no place for it skips), then ``Finished`` with everything the
accounting added (citations, the sources' highlights, stats, usage). A stream reports an error raised after
its response began as a last ``Failed`` event instead (``app.answering.pipeline.in_band``).

The events are frozen and already in the APIs' shapes (``app.schemas``), so a route only frames them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from app.schemas import AskStats, Citations, Source, TokenLogprobOut, Usage


@dataclass(frozen=True)
class Sources:
    """The retrieved chunks, best first, before the generation is queued; their ``highlights`` are empty (the
    citations, attributed after the last token, bring them: ``Finished.sources``)."""

    sources: tuple[Source, ...]


@dataclass(frozen=True)
class Waiting:
    """The generation waits for the engine: ``position`` 1 runs next; ``eta_s`` the estimated seconds until it
    starts, None until a generation has been timed."""

    position: int
    eta_s: float | None

    def payload(self) -> dict[str, object]:
        return {"stage": "queued", "position": self.position, "eta_s": self.eta_s}


@dataclass(frozen=True)
class Prefill:
    """The prompt is being read: ``done`` of its ``total`` tokens have their KV, ``reused`` of them from the
    prefix cache."""

    done: int
    total: int
    reused: int

    def payload(self) -> dict[str, object]:
        return {"stage": "prefill", "done": self.done, "total": self.total, "reused": self.reused}


Progress: TypeAlias = Waiting | Prefill


@dataclass(frozen=True)
class Token:
    """Text that became final. ``logprobs``: its tokens' log-probabilities when the request asked for them,
    else None."""

    text: str
    logprobs: tuple[TokenLogprobOut, ...] | None = None


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text that became final: a harmony model's analysis channel (gpt-oss), never part of the answer.
    The OpenAI chat API streams it as ``reasoning_content``; the other APIs leave it out."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The answer, after its accounting (citations, session history, cross-session draft cache) has run.

    ``sources`` are those of ``Sources`` with their highlights set; ``logprobs`` is every answer token's when
    asked (None otherwise), ``trailing_logprobs`` those of the tokens no ``Token`` carried, their text never
    shown (cut by a stop string)."""

    text: str
    finish_reason: str  # 'stop' (EOS or a stop string), 'length', 'cancelled'
    sources: tuple[Source, ...]
    citations: Citations
    stats: AskStats
    usage: Usage
    logprobs: tuple[TokenLogprobOut, ...] | None = None
    trailing_logprobs: tuple[TokenLogprobOut, ...] = ()
    reasoning: str | None = None  # a harmony model's analysis channel ("" where it wrote none); else None


AnswerEvent: TypeAlias = Sources | Waiting | Prefill | Token | Reasoning | Finished


@dataclass(frozen=True)
class Failed:
    """A stream's last event when its answer failed after the response began (its status already sent): the
    error's code and message, as an HTTP error body would carry them."""

    code: str
    message: str
