"""Small frozen configs built once from ``Settings``: the only place settings turn into plain values."""

from __future__ import annotations

from dataclasses import dataclass

from app.settings import Settings


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request; anything past them is a 413 / 422, never a 5xx."""

    max_upload_bytes: int
    max_question_chars: int
    max_document_ids: int
    max_new_tokens: int
    default_max_tokens: int


@dataclass(frozen=True)
class PenaltyDefaults:
    """The penalties a request gets when it gives none (``RAGSPEC_DEFAULT_*_PENALTY``)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0


@dataclass(frozen=True)
class SessionConfig:
    session_ttl_s: int
    max_turns: int = 8  # turns of history fed back to the target


@dataclass(frozen=True)
class StreamingConfig:
    sse_ping_s: float  # keep-alive comments on an SSE stream until its first token


@dataclass(frozen=True)
class RapidConfig:
    context_tokens: int  # the retrieved chunks RAPID's drafter reads, at most


@dataclass(frozen=True)
class HealthConfig:
    min_free_disk_bytes: int  # /readyz reports not ready below this much free disk under the data dir


@dataclass(frozen=True)
class ServiceConfig:
    limits: RequestLimits
    sessions: SessionConfig
    api_keys: tuple[str, ...]
    streaming: StreamingConfig
    rapid: RapidConfig
    health: HealthConfig
    penalties: PenaltyDefaults = PenaltyDefaults()

    @classmethod
    def from_settings(cls, settings: Settings) -> ServiceConfig:
        return cls(
            limits=RequestLimits(
                max_upload_bytes=int(settings.max_upload_mb * 1024 * 1024),
                max_question_chars=settings.max_question_chars,
                max_document_ids=settings.max_document_ids,
                max_new_tokens=settings.max_new_tokens,
                default_max_tokens=min(settings.default_max_tokens, settings.max_new_tokens),
            ),
            sessions=SessionConfig(session_ttl_s=settings.session_ttl_s),
            api_keys=tuple(settings.api_keys),
            streaming=StreamingConfig(sse_ping_s=settings.sse_ping_s),
            rapid=RapidConfig(context_tokens=settings.rapid_context_tokens),
            health=HealthConfig(min_free_disk_bytes=int(settings.min_free_disk_mb * 1024 * 1024)),
            penalties=PenaltyDefaults(settings.default_frequency_penalty, settings.default_presence_penalty,
                                      settings.default_repetition_penalty),
        )
