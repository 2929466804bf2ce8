"""The documents table (one row of metadata per document).

A SQLite store made before the catalogue had migrations already holds this table, with these columns: it is adopted
as it is (the revision recorded, nothing else done). The columns are written out here rather than taken from
``retrieval.catalogue``: a revision is a snapshot, and later changes to the table come as revisions of their own.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("documents"):
        return
    op.create_table(
        "documents",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("title", sa.Text, nullable=False),
        sa.Column("filename", sa.Text),
        sa.Column("content_type", sa.Text),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("progress", sa.Double, nullable=False, server_default="0"),
        sa.Column("message", sa.Text),
        sa.Column("n_chunks", sa.Integer, nullable=False, server_default="0"),
        sa.Column("n_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("embedder", sa.Text),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_index("documents_tenant", "documents", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("documents_tenant", table_name="documents")
    op.drop_table("documents")
