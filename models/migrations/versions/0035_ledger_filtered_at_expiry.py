"""the accept writes no ledger row for a filtered delivery: retention appends it at expiry

Issue 37's receiver floor (a route filter that drops 90% of the events costs at most 1.1x per
accepted request): 0034's append in the accept's verdict branch was, measured, the whole of
Postgres's extra cost per filtered request (bench/results_receiver.txt: the stack CPU went
from 1.27x to 1.05x the unfiltered route's without it). The row is read only once the
receipt has expired (until then ``events show`` reads the delivery itself), so it is now
appended by the statement that deletes the filtered delivery at its expiry, in both of
retention's modes (:func:`models.ledger.deleting`): once, off the serving path.

Upgrade: the accept functions are 0028's again (0034's downgrade). A filtered delivery
accepted under 0034 already has its row; retention appends a second one, with the same entry
(``<route>.0f``), which readers merge into one (:func:`models.ledger_reads.merged`).

Downgrade: 0034's bodies again (the accept appends the row). A filtered delivery accepted
under this revision has no row until retention deletes it, and 0034's code does not append it
there: those still live when 0034's code runs expire unrecorded, as before 0034.

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-08
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

revision: str = "0035"
down_revision: str | None = "0034"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _revision_0034() -> object:
    return importlib.import_module("models.migrations.versions.0034_ledger_filtered")


def upgrade() -> None:
    _revision_0034().downgrade()  # type: ignore[attr-defined]


def downgrade() -> None:
    _revision_0034().upgrade()  # type: ignore[attr-defined]
