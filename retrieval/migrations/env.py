"""Alembic's environment for the catalogue: always run on the connection ``retrieval.catalogue.upgrade`` hands it
(``config.attributes["connection"]``), SQLite or PostgreSQL alike."""

from __future__ import annotations

from alembic import context

from retrieval.catalogue import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
