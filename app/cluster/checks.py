"""What cluster mode asks of the settings, without Ray (the command checks them before importing it): that the
replicas can share what they must, each replica's own settings, and the settings carried to them as data."""

from __future__ import annotations

from typing import Any

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


def settings_data(settings: Settings) -> dict[str, Any]:
    """The settings as a replica is given them: JSON-able data (Ray carries it to the replica's process), with the
    three directories absolute, as the command resolves them (a replica's working dir is not the command's)."""
    absolute = settings.model_copy(update={"data_dir": settings.data_dir.resolve(),
                                           "documents_dir": settings.documents_dir.resolve(),
                                           "models_dir": settings.models_dir.resolve()})
    return absolute.model_dump(mode="json")


def settings_from_data(data: dict[str, Any]) -> Settings:
    """The settings ``settings_data`` gave, validated again (``model_validate``, not the constructor: the replica's
    own ``RAGSPEC_*`` environment is not read)."""
    return Settings.model_validate(data)
