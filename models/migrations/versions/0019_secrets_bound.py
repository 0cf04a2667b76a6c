"""stored secrets are bound to their place (no schema change: a revision that code needs)

From this revision on, every stored secret's ciphertext is sealed with its table, row and
purpose (``core.crypto.Place``), and the code refuses one that is not. The schema does not
change; what changes is the data, which a migration cannot rewrite without the key:
``webhooks db upgrade`` runs this revision and then binds every stored secret in place
(``models.db.upgrade`` -> ``models.keys.rekey``), and ``webhooks serve`` / ``run`` refuse a
database a revision behind their code, so no process reads unbound secrets by accident. A
database migrated with plain ``alembic upgrade`` is bound by ``webhooks secrets rekey``.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Nothing in the schema: the binding is data, written by ``webhooks db upgrade``."""


def downgrade() -> None:
    """Nothing to undo in the schema (code before 0019 cannot read bound secrets: rekey with
    that code's release is not possible, restore a backup instead)."""
