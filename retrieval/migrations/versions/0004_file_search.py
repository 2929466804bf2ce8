"""OpenAI's file search on the catalogue: a document's ``purpose`` (as uploaded through ``/v1/files``), a
collection's expiry (``expires_after_days`` after ``last_active_at``, as a vector store's), and file batches
(``file_batches``: a set of documents added to a collection together, which may be cancelled;
``file_batch_documents``: its documents, each marked when the cancel took it out, and whether the batch put it in
the collection: a cancel takes out only those), and stored responses
(``responses``: the Responses API's answers, each naming the one it follows). Only new columns (null for the
existing rows) and tables: nothing an existing store holds changes.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("documents", sa.Column("purpose", sa.Text))
    op.add_column("collections", sa.Column("expires_after_days", sa.Integer))
    op.add_column("collections", sa.Column("last_active_at", sa.Double))
    op.create_table(
        "file_batches",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("collection_id", sa.Text, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("cancelled_at", sa.Double),
    )
    op.create_index("file_batches_collection", "file_batches", ["collection_id"])
    op.create_table(
        "file_batch_documents",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column("doc_id", sa.Text, primary_key=True),
        sa.Column("cancelled", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("added", sa.Boolean, nullable=False, server_default=sa.true()),  # the batch put it in the store
    )
    op.create_index("file_batch_documents_doc", "file_batch_documents", ["doc_id"])
    op.create_table(
        "responses",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("previous_id", sa.Text),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("body", sa.Text, nullable=False),  # the response object, JSON
    )


def downgrade() -> None:
    op.drop_table("responses")
    op.drop_index("file_batch_documents_doc", table_name="file_batch_documents")
    op.drop_table("file_batch_documents")
    op.drop_index("file_batches_collection", table_name="file_batches")
    op.drop_table("file_batches")
    op.drop_column("collections", "last_active_at")
    op.drop_column("collections", "expires_after_days")
    op.drop_column("documents", "purpose")
