"""a test event says so: ``receipts.arrived_via`` may be ``test`` (issue 34 item 5)

``webhooks send`` posts a signed event through the receiver with a header the receiver
verifies (an HMAC under ``WEBHOOKS_SECRET_KEY``, :mod:`core.send_marks`); such an event is
recorded with ``arrived_via = 'test'`` (``SET LOCAL webhooks.arrived_via``, as reconciliation
does) and an ``audit_log`` row in the same transaction. This revision widens the column's
CHECK to allow the new value. Every existing row satisfies both, but Postgres checks the new
constraint against every partition under the table's lock (a partitioned table takes no
``NOT VALID`` check on 15): a scan of ``receipts``, once.

Downgrade: test receipts become ``webhook`` again (the old constraint's only fitting value;
their audit rows say they were test sends).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint(op.f("ck_receipts_arrived_via"), "receipts", type_="check")
    op.create_check_constraint(
        "arrived_via", "receipts", "arrived_via IN ('webhook', 'reconcile', 'test')"
    )


def downgrade() -> None:
    op.execute("UPDATE receipts SET arrived_via = 'webhook' WHERE arrived_via = 'test'")
    op.drop_constraint(op.f("ck_receipts_arrived_via"), "receipts", type_="check")
    op.create_check_constraint("arrived_via", "receipts", "arrived_via IN ('webhook', 'reconcile')")
