"""The subscription watchdog's findings (issue 38 item 1, migration 0030): opened once and
closed once, by guarded SQL on the database's clock, each with an ``audit_log`` row.

An open finding is the one row of its (source, kind) with ``closed_at`` NULL (a partial
unique index): opening is ``INSERT ... ON CONFLICT DO NOTHING`` (a finding already open
stays as it is, its ``opened_at`` the first time it was seen), closing is ``UPDATE ... WHERE
closed_at IS NULL``. Two checks racing open or close a finding once, and audit it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.watchdog import CANNOT_CHECK, JUDGED, Finding
from models.catalog import Change, record_audit

OPERATOR = "watchdog"  # the audit rows' operator: the check, not a person
OPEN_ACTION = "finding.open"
CLOSE_ACTION = "finding.close"

_OPEN = text(
    """
INSERT INTO subscription_findings (source_id, kind, detail)
VALUES (:s, :kind, :detail)
ON CONFLICT (source_id, kind) WHERE closed_at IS NULL DO NOTHING
RETURNING id
"""
)
# An open finding's detail follows what the provider says now (a URL that changed again).
_DETAIL = text(
    "UPDATE subscription_findings SET detail = :detail"
    " WHERE source_id = :s AND kind = :kind AND closed_at IS NULL AND detail <> :detail"
)
_CLOSE = text(
    "UPDATE subscription_findings SET closed_at = now()"
    " WHERE source_id = :s AND kind = :kind AND closed_at IS NULL RETURNING id, detail"
)


@dataclass(frozen=True)
class Recorded:
    opened: list[str]
    closed: list[str]


def record(
    session: Session,
    source_id: int,
    public_id: str,
    found: list[Finding],
    *,
    answered: bool,
    via: str,
) -> Recorded:
    """Open what ``found`` holds and is not open; close the judged kinds it does not hold
    (``answered``: the provider said; otherwise only ``cannot_check`` is in ``found`` and
    the other kinds are left as they were). In the caller's transaction."""
    kinds = {f.kind for f in found}
    opened, closed = [], []
    for finding in found:
        params = {"s": source_id, "kind": finding.kind, "detail": finding.detail}
        row = session.execute(_OPEN, params).first()
        if row is None:
            session.execute(_DETAIL, params)
            continue
        opened.append(finding.kind)
        _audit(session, OPEN_ACTION, public_id, int(row[0]), finding.kind, finding.detail, via)
    for kind in (*JUDGED, CANNOT_CHECK) if answered else ():
        if kind in kinds:
            continue
        row = session.execute(_CLOSE, {"s": source_id, "kind": kind}).first()
        if row is not None:
            closed.append(kind)
            _audit(session, CLOSE_ACTION, public_id, int(row[0]), kind, "back to normal", via)
    return Recorded(opened, closed)


def _audit(
    session: Session, action: str, public_id: str, finding_id: int, kind: str, why: str, via: str
) -> None:
    target = {"source": public_id, "finding": finding_id, "kind": kind}
    record_audit(session, Change(OPERATOR, why, via=via), action, target, count=1, now=None)


@dataclass(frozen=True)
class OpenFinding:
    source: str  # public id
    name: str
    kind: str
    detail: str
    opened_at: datetime

    def view(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "kind": self.kind,
            "detail": self.detail,
            "opened_at": self.opened_at,
        }


_OPEN_ROWS = """
SELECT s.public_id, s.name, f.kind, f.detail, f.opened_at
FROM subscription_findings f JOIN sources s ON s.id = f.source_id
WHERE f.closed_at IS NULL {where}
ORDER BY s.public_id, f.kind
"""


def open_findings(session: Session, source_id: int | None = None) -> list[OpenFinding]:
    where = "" if source_id is None else "AND f.source_id = :s"
    rows = session.execute(text(_OPEN_ROWS.format(where=where)), {"s": source_id})
    return [OpenFinding(*r) for r in rows]


def gauge_rows(session: Session) -> list[tuple[str, str, bool]]:
    """(source public id, kind, open) of every (source, kind) with a finding, open or not:
    what ``webhooks_subscription_findings`` shows (0 once closed)."""
    rows = session.execute(
        text(
            "SELECT s.public_id, f.kind, bool_or(f.closed_at IS NULL)"
            " FROM subscription_findings f JOIN sources s ON s.id = f.source_id"
            " GROUP BY s.public_id, f.kind"
        )
    )
    return [(str(r[0]), str(r[1]), bool(r[2])) for r in rows]
