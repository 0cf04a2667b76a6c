"""Payload shape drift's storage (issue 38 item 3): learning, findings, accepting. Plain
psycopg, no ORM: ``webhooks drift list`` reads through here and stays light.

Learning (:func:`learn_due`) is one transaction. Its first statement claims the period on the
database's clock (``drift_marks.ran_at`` moved to ``now()`` only when the period has passed):
a concurrent run waits on that row and then finds the period taken, so two workers, or beat
firing twice, never learn one period twice. It then reads the receipts accepted since the
mark that still hold their body, at most ``sample`` per (source, event type) (the newest),
fingerprints each (:mod:`core.shapes`), and stores the shapes and the findings; the mark
moves in the same commit. Findings are inserted ``ON CONFLICT DO NOTHING`` against the
partial unique index of open findings: one open finding per (source, event type, path,
kind), whoever sees it.

The receiver and the delivery workers do none of this: it runs on the maintenance queue.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from core import shapes
from core.shapes import Change, Fingerprint, NotJson, PathSeen
from core.states import DRIFT_HELD, DRIFT_REPLAYED
from models.views import CatalogError

Conn = psycopg.Connection[Any]

ACCEPT_ACTION = "drift.accept"
OPEN_ACTION = "drift.open"
# How long after its arrival a receipt is read by a learning run (see learn_due).
SETTLE = timedelta(minutes=1)
# The audit trail's operator (and via) of a finding the learning run opened.
LEARNER = "drift"


@dataclass
class LearnReport:
    """What one learning run did; ``claimed`` False: the period was taken (nothing done)."""

    claimed: bool
    read: int = 0
    not_json: int = 0
    cut_paths: int = 0
    shapes: int = 0
    opened: list[tuple[str, str, str, str]] = field(default_factory=list)
    through_receipt_id: int = 0


CLAIM = """
UPDATE drift_marks SET ran_at = now()
WHERE singleton AND (ran_at IS NULL OR ran_at + %(every)s <= now())
RETURNING through_receipt_id, now() AS now
"""

# The newest ``sample`` receipts per (source, event type) after the mark, with their bodies.
SAMPLE = """
WITH fresh AS (
    SELECT id, expires_at, source_id, event_type, received_at,
           row_number() OVER (PARTITION BY source_id, event_type ORDER BY id DESC) AS n
    FROM receipts
    WHERE id > %(mark)s AND id <= %(upto)s AND payload IS NOT NULL
)
SELECT f.id, f.source_id, f.event_type, f.received_at, r.payload
FROM fresh f
JOIN receipts r ON r.id = f.id AND r.expires_at = f.expires_at
WHERE f.n <= %(sample)s
ORDER BY f.source_id, f.event_type, f.id
"""

UPSERT_SHAPE = """
INSERT INTO drift_shapes (source_id, event_type, first_seen, last_seen, sightings, cut_paths)
VALUES (%(source_id)s, %(event_type)s, %(first)s, %(last)s, %(n)s, %(cut)s)
ON CONFLICT (source_id, event_type) DO UPDATE
SET last_seen = greatest(drift_shapes.last_seen, EXCLUDED.last_seen),
    sightings = drift_shapes.sightings + EXCLUDED.sightings,
    cut_paths = drift_shapes.cut_paths + EXCLUDED.cut_paths
RETURNING (xmax = 0) AS created
"""

UPSERT_PATH = """
INSERT INTO drift_paths (source_id, event_type, path, types, first_seen, last_seen, sightings)
VALUES (%(source_id)s, %(event_type)s, %(path)s, %(types)s, %(first)s, %(last)s, 1)
ON CONFLICT (source_id, event_type, path) DO UPDATE
SET types = ARRAY(SELECT DISTINCT t FROM unnest(drift_paths.types || EXCLUDED.types) AS t
                  ORDER BY t),
    first_seen = least(drift_paths.first_seen, EXCLUDED.first_seen),
    last_seen = greatest(drift_paths.last_seen, EXCLUDED.last_seen),
    sightings = drift_paths.sightings + 1
"""

OPEN_FINDING = """
INSERT INTO drift_findings (source_id, event_type, path, kind, detail, opened_at)
VALUES (%(source_id)s, %(event_type)s, %(path)s, %(kind)s, %(detail)s, %(now)s)
ON CONFLICT (source_id, event_type, path, kind) WHERE accepted_at IS NULL DO NOTHING
RETURNING id
"""

# Paths not seen for the absence window whose event type arrived after them.
GONE_CANDIDATES = """
SELECT p.source_id, p.event_type, p.path, p.types, p.first_seen, p.last_seen,
       s.last_seen AS type_last_seen
FROM drift_paths p
JOIN drift_shapes s ON s.source_id = p.source_id AND s.event_type = p.event_type
WHERE p.last_seen <= %(now)s - %(absent)s AND s.last_seen > p.last_seen
ORDER BY p.source_id, p.event_type, p.path
"""


def learn_due(
    conn: Conn,
    *,
    every: timedelta,
    sample: int,
    absent: timedelta,
    now: datetime | None = None,
) -> LearnReport:
    """One learning run, if its period (``every``) has passed; ``now``: the instant findings
    are judged at (None: the database's clock). Commits on ``conn``."""
    with conn.transaction():
        claimed = conn.execute(CLAIM, {"every": every}).fetchone()
        if claimed is None:
            return LearnReport(claimed=False)
        mark = int(claimed[0])
        at: datetime = now if now is not None else claimed[1]
        report = LearnReport(claimed=True, through_receipt_id=mark)
        # Only receipts received SETTLE ago or earlier (the database's clock): a receipt
        # numbered below one read here but committed after this run would be behind the mark
        # for ever; accept transactions take milliseconds.
        upto_row = conn.execute(
            "SELECT max(id) FROM receipts WHERE id > %s AND received_at <= now() - %s",
            (mark, SETTLE),
        ).fetchone()
        upto = int(upto_row[0]) if upto_row is not None and upto_row[0] is not None else mark
        if upto > mark:
            rows = conn.execute(SAMPLE, {"mark": mark, "upto": upto, "sample": sample}).fetchall()
            group: list[tuple[datetime, Fingerprint]] = []
            key: tuple[int, str] | None = None
            for row in rows:
                if key is not None and (row[1], row[2]) != key:
                    _learn_group(conn, key, group, at, report)
                    group = []
                key = (int(row[1]), str(row[2]))
                report.read += 1
                try:
                    group.append((row[3], shapes.fingerprint_body(bytes(row[4]))))
                except NotJson:
                    report.not_json += 1
            if key is not None:
                _learn_group(conn, key, group, at, report)
        for source_id, event_type, change in _gone(conn, at, absent):
            _open(conn, source_id, event_type, change, at, report)
        conn.execute(
            "UPDATE drift_marks SET through_receipt_id = greatest(through_receipt_id, %s)"
            " WHERE singleton",
            (upto,),
        )
        report.through_receipt_id = upto
    return report


def _learn_group(
    conn: Conn,
    key: tuple[int, str],
    group: Sequence[tuple[datetime, Fingerprint]],
    now: datetime,
    report: LearnReport,
) -> None:
    if not group:
        return
    source_id, event_type = key
    cut = sum(fp.cut for _, fp in group)
    report.cut_paths += cut
    report.shapes += 1
    # The shape's row first: its lock orders every run that learns this event type.
    created = conn.execute(
        UPSERT_SHAPE,
        {
            "source_id": source_id,
            "event_type": event_type,
            "first": min(at for at, _ in group),
            "last": max(at for at, _ in group),
            "n": len(group),
            "cut": cut,
        },
    ).fetchone()
    baseline = created is not None and not created[0]
    stored = {
        r[0]: PathSeen(frozenset(r[1]), r[2], r[3])
        for r in conn.execute(
            "SELECT path, types, first_seen, last_seen FROM drift_paths"
            " WHERE source_id = %s AND event_type = %s",
            (source_id, event_type),
        )
    }
    for received_at, fp in group:
        merged = shapes.merge(stored, fp, baseline=baseline)
        for change in merged.changes:
            _open(conn, source_id, event_type, change, now, report)
        for path, types in merged.seen.items():
            known = stored.get(path)
            stored[path] = PathSeen(
                types | (known.types if known else frozenset()),
                min(known.first_seen, received_at) if known else received_at,
                max(known.last_seen, received_at) if known else received_at,
            )
            conn.execute(
                UPSERT_PATH,
                {
                    "source_id": source_id,
                    "event_type": event_type,
                    "path": path,
                    "types": sorted(types),
                    "first": received_at,
                    "last": received_at,
                },
            )
        baseline = True


def _gone(conn: Conn, now: datetime, absent: timedelta) -> Iterable[tuple[int, str, Change]]:
    rows = conn.execute(GONE_CANDIDATES, {"now": now, "absent": absent}).fetchall()
    for r in rows:
        stored = {r[2]: PathSeen(frozenset(r[3]), r[4], r[5])}
        for change in shapes.gone(stored, r[6], now, absent):
            yield int(r[0]), str(r[1]), change


def _open(
    conn: Conn, source_id: int, event_type: str, change: Change, now: datetime, report: LearnReport
) -> None:
    opened = conn.execute(
        OPEN_FINDING,
        {
            "source_id": source_id,
            "event_type": event_type,
            "path": change.path,
            "kind": change.kind,
            "detail": change.detail,
            "now": now,
        },
    ).fetchone()
    if opened is not None:
        # Opened, audited in the same transaction (as the sweeper audits a route it disables).
        conn.execute(
            "INSERT INTO audit_log (at, operator, action, target, reason, count, via)"
            " SELECT %(now)s, %(who)s, %(action)s,"
            " jsonb_build_object('source', s.public_id, 'event_type', %(event_type)s::text,"
            " 'path', %(path)s::text, 'kind', %(kind)s::text, 'finding', %(id)s::bigint),"
            " %(detail)s, 1, %(who)s FROM sources s WHERE s.id = %(source_id)s",
            {
                "now": now,
                "who": LEARNER,
                "action": OPEN_ACTION,
                "event_type": event_type,
                "path": change.path,
                "kind": change.kind,
                "id": int(opened[0]),
                "detail": change.detail,
                "source_id": source_id,
            },
        )
        report.opened.append((str(source_id), event_type, change.path, change.kind))


@dataclass(frozen=True)
class Finding:
    id: int
    source: str
    source_name: str
    event_type: str
    path: str
    kind: str
    detail: str
    opened_at: datetime
    accepted_at: datetime | None
    accepted_by: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "source_name": self.source_name,
            "event_type": self.event_type,
            "path": self.path,
            "kind": self.kind,
            "detail": self.detail,
            "opened_at": self.opened_at.isoformat(),
            "accepted_at": self.accepted_at.isoformat() if self.accepted_at else None,
            "accepted_by": self.accepted_by,
        }


def source_id(conn: Conn, ref: str) -> tuple[int, str]:
    """A source by public id, else by an unambiguous name: (id, public id)."""
    row = conn.execute("SELECT id, public_id FROM sources WHERE public_id = %s", (ref,)).fetchone()
    if row is not None:
        return int(row[0]), str(row[1])
    by_name = conn.execute("SELECT id, public_id FROM sources WHERE name = %s", (ref,)).fetchall()
    if len(by_name) == 1:
        return int(by_name[0][0]), str(by_name[0][1])
    if len(by_name) > 1:
        raise CatalogError(f"source name {ref!r} is ambiguous; use the source id")
    raise CatalogError(f"no such source: {ref!r}")


def list_findings(
    conn: Conn, *, source: str | None = None, include_accepted: bool = False, limit: int = 500
) -> list[Finding]:
    """Open findings (and accepted ones when asked), newest first."""
    sid = None if source is None else source_id(conn, source)[0]
    rows = conn.execute(
        "SELECT f.id, s.public_id, s.name, f.event_type, f.path, f.kind, f.detail,"
        " f.opened_at, f.accepted_at, f.accepted_by"
        " FROM drift_findings f JOIN sources s ON s.id = f.source_id"
        " WHERE (%(sid)s::bigint IS NULL OR f.source_id = %(sid)s)"
        " AND (%(all)s OR f.accepted_at IS NULL)"
        " ORDER BY f.opened_at DESC, f.id DESC LIMIT %(limit)s",
        {"sid": sid, "all": include_accepted, "limit": limit},
    ).fetchall()
    return [Finding(*r) for r in rows]


def open_counts(conn: Conn) -> dict[tuple[str, str], int]:
    """Open findings per (source public id, kind), with 0 for each kind of every source that
    has a learnt shape or any finding (so a gauge falls back to 0 once accepted)."""
    counts: dict[tuple[str, str], int] = {}
    for (public_id,) in conn.execute(
        "SELECT s.public_id FROM sources s WHERE EXISTS"
        " (SELECT 1 FROM drift_shapes d WHERE d.source_id = s.id)"
        " OR EXISTS (SELECT 1 FROM drift_findings f WHERE f.source_id = s.id)"
    ).fetchall():
        for kind in shapes.KINDS:
            counts[(str(public_id), kind)] = 0
    for public_id, kind, n in conn.execute(
        "SELECT s.public_id, f.kind, count(*) FROM drift_findings f"
        " JOIN sources s ON s.id = f.source_id WHERE f.accepted_at IS NULL"
        " GROUP BY s.public_id, f.kind"
    ).fetchall():
        counts[(str(public_id), str(kind))] = int(n)
    return counts


@dataclass(frozen=True)
class Accepted:
    source: str
    event_type: str | None
    findings: int
    audit_id: int | None
    released: int = 0


def accept(
    conn: Conn, ref: str, *, event_type: str | None, operator: str, reason: str, via: str = "cli"
) -> Accepted:
    """Close the source's open findings (of ``event_type`` only, when given) and make the
    shape as it now stands the accepted one: a path reported gone leaves the shape, and the
    shapes of the events a quarantined route holds join it; those deliveries are released.
    One ``audit_log`` row in the same transaction. Nothing open and nothing held: nothing
    written, no audit."""
    if not reason.strip():
        raise CatalogError("--reason is required: it is recorded in the audit trail")
    if not operator.strip():
        raise CatalogError("an operator name is required (--operator)")
    with conn.transaction():
        sid, public_id = source_id(conn, ref)
        closed = conn.execute(
            "UPDATE drift_findings SET accepted_at = now(), accepted_by = %(op)s"
            " WHERE source_id = %(sid)s AND accepted_at IS NULL"
            " AND (%(type)s::text IS NULL OR event_type = %(type)s)"
            " RETURNING event_type, path, kind",
            {"op": operator.strip(), "sid": sid, "type": event_type},
        ).fetchall()
        # The held deliveries' events are part of the new shape, whether or not a learning
        # run sampled them: each one's paths are learnt here, so that released it passes.
        held = conn.execute(
            HELD_EVENTS, {"sid": sid, "held": HELD_CLASS, "type": event_type}
        ).fetchall()
        if not closed and not held:
            return Accepted(public_id, event_type, 0, None)
        for et, received_at, payload, _ in held:
            try:
                sighting = shapes.fingerprint_body(bytes(payload))
            except NotJson:
                continue
            conn.execute(
                "UPDATE drift_shapes SET sightings = sightings + 1,"
                " last_seen = greatest(last_seen, %s) WHERE source_id = %s AND event_type = %s",
                (received_at, sid, et),
            )
            for path, types in sighting.paths().items():
                conn.execute(
                    UPSERT_PATH,
                    {
                        "source_id": sid,
                        "event_type": et,
                        "path": path,
                        "types": sorted(types),
                        "first": received_at,
                        "last": received_at,
                    },
                )
        # Deliveries a quarantined route held for drift are due now (the sweeper publishes
        # them); a worker checks each against the shape as accepted here before its handler.
        released = conn.execute(
            RELEASE, {"sid": sid, "held": HELD_CLASS, "type": event_type}
        ).rowcount
        for et, path, kind in closed:
            if kind == "path_gone":
                conn.execute(
                    "DELETE FROM drift_paths WHERE source_id = %s AND event_type = %s"
                    " AND path = %s",
                    (sid, et, path),
                )
        target = {
            "source": public_id,
            "event_type": event_type,
            "findings": sorted({f"{et} {path} {kind}" for et, path, kind in closed}),
            "released": released,
        }
        audit = conn.execute(
            "INSERT INTO audit_log (at, operator, action, target, reason, count, via)"
            " VALUES (now(), %s, %s, %s::jsonb, %s, %s, %s) RETURNING id",
            (
                operator.strip(),
                ACCEPT_ACTION,
                json.dumps(target),
                reason.strip(),
                len(closed) + released,
                via,
            ),
        ).fetchone()
        assert audit is not None
    return Accepted(public_id, event_type, len(closed), int(audit[0]), released)


# A delivery held for drift (tasks/steps/run.py): retrying, its error class this, due again
# after :data:`HOLD_RECHECK` unless an accept releases it first.
HELD_CLASS = DRIFT_HELD
# A held delivery an operator replayed by its id (models/replays.py): not held again.
REPLAYED_CLASS = DRIFT_REPLAYED
HOLD_RECHECK = timedelta(days=1)


# An event type's paths count as "always had" once this many of its events were learnt.
ALWAYS_AFTER = 3


@dataclass(frozen=True)
class AcceptedShape:
    """What a quarantined route's events are checked against (:func:`core.shapes.drift_of`)."""

    paths: dict[str, frozenset[str]]
    unaccepted: frozenset[str]
    always: frozenset[str]


def accepted_shape(conn: Conn, source_id: int, event_type: str) -> AcceptedShape:
    """The learnt shape of an event type (path: types), its paths with an open new-path or
    type-changed finding (not accepted yet), and the paths every one of its learnt events had
    (once at least :data:`ALWAYS_AFTER` were learnt)."""
    rows = conn.execute(
        "SELECT p.path, p.types, p.sightings >= s.sightings AND s.sightings >= %s"
        " FROM drift_paths p JOIN drift_shapes s"
        " ON s.source_id = p.source_id AND s.event_type = p.event_type"
        " WHERE p.source_id = %s AND p.event_type = %s",
        (ALWAYS_AFTER, source_id, event_type),
    ).fetchall()
    open_paths = frozenset(
        str(r[0])
        for r in conn.execute(
            "SELECT path FROM drift_findings WHERE source_id = %s AND event_type = %s"
            " AND accepted_at IS NULL AND kind IN ('new_path', 'type_changed')",
            (source_id, event_type),
        )
    )
    return AcceptedShape(
        {str(r[0]): frozenset(r[1]) for r in rows},
        open_paths,
        frozenset(str(r[0]) for r in rows if r[2]),
    )


# The events of the source's deliveries held for drift that still hold their body.
HELD_EVENTS = """
SELECT DISTINCT r.event_type, r.received_at, r.payload, r.id
FROM deliveries d
JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at
WHERE d.source_id = %(sid)s AND d.status = 'retrying' AND d.last_error_class = %(held)s
  AND r.payload IS NOT NULL AND (%(type)s::text IS NULL OR r.event_type = %(type)s)
ORDER BY r.id
"""

RELEASE = """
UPDATE deliveries d SET next_attempt_at = now(), updated_at = now()
FROM receipts r
WHERE d.source_id = %(sid)s AND d.status = 'retrying' AND d.last_error_class = %(held)s
  AND r.id = d.receipt_id AND r.expires_at = d.expires_at
  AND (%(type)s::text IS NULL OR r.event_type = %(type)s)
"""


def held_count(conn: Conn, source_id: int, event_type: str | None) -> int:
    """The source's deliveries held for drift (of ``event_type``, when given)."""
    row = conn.execute(
        "SELECT count(*) FROM deliveries d JOIN receipts r"
        " ON r.id = d.receipt_id AND r.expires_at = d.expires_at"
        " WHERE d.source_id = %(sid)s AND d.status = 'retrying' AND d.last_error_class = %(held)s"
        " AND (%(type)s::text IS NULL OR r.event_type = %(type)s)",
        {"sid": source_id, "held": HELD_CLASS, "type": event_type},
    ).fetchone()
    return int(row[0]) if row is not None else 0


def replayed_past_hold(conn: Conn, delivery_id: int, expires_at: datetime, attempt: int) -> bool:
    """Whether this attempt (``attempt``, the claim's number, still processing) belongs to a
    held delivery an operator replayed by its id (``webhooks replay ID``): the operator
    decided it runs on the shape it has, so check_drift does not hold it again. Only this
    delivery: another drifted event of the route is held as before. The mark stays until the
    delivery fails or succeeds (a redelivery after a crash keeps it)."""
    row = conn.execute(
        "SELECT 1 FROM deliveries WHERE id = %s AND expires_at = %s AND attempts = %s"
        " AND status = 'processing' AND last_error_class = %s",
        (delivery_id, expires_at, attempt, REPLAYED_CLASS),
    ).fetchone()
    return row is not None
