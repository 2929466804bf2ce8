"""Ingestion jobs with leases: a document waiting for (or under) ingestion has a row; a worker claims it by writing
its name and a lease expiry, renews the lease while it works and deletes the row when done. A row whose lease ran
out (its worker died) is claimed by another worker. Columns written out as in 0001.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ingest_jobs",
        sa.Column("doc_id", sa.Text, primary_key=True),
        sa.Column("owner", sa.Text),
        sa.Column("lease_until", sa.Double),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_index("ingest_jobs_created", "ingest_jobs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ingest_jobs_created", table_name="ingest_jobs")
    op.drop_table("ingest_jobs")
