"""What cluster mode asks of the settings, without Ray (the command checks them before importing it)."""

from __future__ import annotations

from app.settings import Settings


class ClusterConfigError(Exception):
    """A cluster that cannot start as configured; the message says which setting."""


def check_cluster_settings(settings: Settings) -> None:
    """What replicas must share: the catalogue (PostgreSQL) and sessions (Redis). (At least one replica: the
    settings' own check.)"""
    if not settings.database_url:
        raise ClusterConfigError("RAGSPEC_DATABASE_URL is not set: the replicas share one catalogue, in PostgreSQL")
    if not settings.redis_url:
        raise ClusterConfigError("RAGSPEC_REDIS_URL is not set: the replicas share sessions and drafts through Redis")


def replica_settings(settings: Settings, replica: str) -> Settings:
    """A replica's settings: the shared documents dir and models, its own data dir (KV cache, prefix registry)."""
    return settings.model_copy(update={
        "data_dir": settings.data_dir / "replicas" / replica,
        "documents_dir": settings.documents_dir,
        "models_dir": settings.models_dir,
        "shared_store": True,
    })
