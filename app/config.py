"""The frozen config of the running service, built once from ``Settings``: the only place settings turn into the
plain values that requests, the gate and the services' methods read.

What only builds an object at start-up (model paths, cache budgets, the scheduler's sizes) is read from the settings
by ``app.services.load_services`` and held by the object it builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.settings import Settings


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request; anything past them is a 413 / 422, never a 5xx."""

    max_upload_bytes: int
    max_json_bytes: int  # the body of every route but the upload
    max_question_chars: int
    max_document_ids: int
    max_collection_ids: int
    max_new_tokens: int
    default_max_tokens: int


@dataclass(frozen=True)
class PenaltyDefaults:
    """The penalties a request gets when it gives none (``RAGSPEC_DEFAULT_*_PENALTY``)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0


@dataclass(frozen=True)
class AccessConfig:
    """Who may call: the API keys (each a tenant; none: no auth) and the metrics scraper's token."""

    api_keys: tuple[str, ...] = ()
    metrics_token: str | None = None


@dataclass(frozen=True)
class SessionConfig:
    session_ttl_s: int
    max_turns: int = 8  # turns of history fed back to the target
    keep_sources: bool = True  # each answer's sources kept in its session, shown when it is resumed


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
class CalibrationConfig:
    """Whether the verify cost per draft size is measured: at start, and on a GPU again when requests run at
    longer caches than it was measured at."""

    enabled: bool


@dataclass(frozen=True)
class ServiceConfig:
    limits: RequestLimits
    access: AccessConfig
    sessions: SessionConfig
    streaming: StreamingConfig
    rapid: RapidConfig
    health: HealthConfig
    calibration: CalibrationConfig
    penalties: PenaltyDefaults = PenaltyDefaults()

    @classmethod
    def from_settings(cls, settings: Settings) -> ServiceConfig:
        return cls(
            limits=RequestLimits(
                max_upload_bytes=int(settings.max_upload_mb * 1024 * 1024),
                max_json_bytes=int(settings.max_json_mb * 1024 * 1024),
                max_question_chars=settings.max_question_chars,
                max_document_ids=settings.max_document_ids,
                max_collection_ids=settings.max_collection_ids,
                max_new_tokens=settings.max_new_tokens,
                default_max_tokens=min(settings.default_max_tokens, settings.max_new_tokens),
            ),
            access=AccessConfig(api_keys=tuple(settings.api_keys), metrics_token=settings.metrics_token),
            sessions=SessionConfig(session_ttl_s=settings.session_ttl_s, keep_sources=settings.session_sources),
            streaming=StreamingConfig(sse_ping_s=settings.sse_ping_s),
            rapid=RapidConfig(context_tokens=settings.rapid_context_tokens),
            health=HealthConfig(min_free_disk_bytes=int(settings.min_free_disk_mb * 1024 * 1024)),
            calibration=CalibrationConfig(enabled=settings.calibrate),
            penalties=PenaltyDefaults(settings.default_frequency_penalty, settings.default_presence_penalty,
                                      settings.default_repetition_penalty),
        )
