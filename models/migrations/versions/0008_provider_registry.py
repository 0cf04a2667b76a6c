"""providers come from a registry: drop the CHECK that listed seven of them

``core.providers`` is a registry that new built-in modules and plug-ins (entry-point group
``webhooks.providers``) extend, so the database cannot list the providers: the CLI checks a
new source's provider against the registry, and the receiver answers 401 for a source whose
provider is no longer installed. Downgrade restores the CHECK, which fails while any source
uses a provider outside the original seven (remove those first).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ORIGINAL = ("stripe", "github", "shopify", "slack", "standard", "svix", "hmac")


def upgrade() -> None:
    op.drop_constraint(op.f("ck_sources_provider"), "sources", type_="check")


def downgrade() -> None:
    listed = ", ".join(f"'{name}'" for name in _ORIGINAL)
    op.create_check_constraint(op.f("ck_sources_provider"), "sources", f"provider IN ({listed})")
