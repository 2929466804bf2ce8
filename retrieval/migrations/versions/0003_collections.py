"""Collections and document attributes: ``collections`` (a tenant's named set of documents, with a ``version``
bumped by every change of its members or of their status or attributes), ``collection_documents`` (membership: a
document may belong to several collections) and ``document_attributes`` (one row per key, the value in the column
of its kind, so that filters are evaluated by the database). Only new tables: an existing store's documents and jobs
are left as they are. Columns written out as in 0001.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# strings compare by code point on both databases (SQLite's default; PostgreSQL's "C" collation)
CODE_POINT_TEXT = sa.Text().with_variant(sa.Text(collation="C"), "postgresql")


def upgrade() -> None:
    op.create_table(
        "collections",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("description", sa.Text),
        sa.Column("metadata", sa.Text),
        sa.Column("version", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    op.create_index("collections_tenant", "collections", ["tenant", "created_at", "id"])
    op.create_table(
        "collection_documents",
        sa.Column("collection_id", sa.Text, primary_key=True),
        sa.Column("doc_id", sa.Text, primary_key=True),
        sa.Column("added_at", sa.Double, nullable=False),
    )
    op.create_index("collection_documents_doc", "collection_documents", ["doc_id"])
    op.create_table(
        "document_attributes",
        sa.Column("doc_id", sa.Text, primary_key=True),
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("text_value", CODE_POINT_TEXT),
        sa.Column("num_value", sa.Double),
    )
    op.create_index("document_attributes_key", "document_attributes", ["key", "doc_id"])


def downgrade() -> None:
    op.drop_index("document_attributes_key", table_name="document_attributes")
    op.drop_table("document_attributes")
    op.drop_index("collection_documents_doc", table_name="collection_documents")
    op.drop_table("collection_documents")
    op.drop_index("collections_tenant", table_name="collections")
    op.drop_table("collections")
