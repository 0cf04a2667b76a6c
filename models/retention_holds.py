"""Holds: expiry ends deduplication, never work (the rules: :mod:`models.retention`).

Which expired receipts a delivery still holds (:data:`HELD_SQL`, :func:`held_receipts`),
where each moves (:data:`HOLD_UNTIL`, :func:`hold_end`) and the moves themselves
(:func:`move_held`), shared by partition mode (:mod:`models.retention_expiry`) and delete
mode (:func:`models.retention.hold_in_place`); and the clock every expiry decision reads
(:func:`decision_time`). Only counts are logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, Engine, text

from core.logs import get_logger
from core.settings import Settings
from core.states import UNFINISHED
from models import partitions

log = get_logger("retention")

# How far a held receipt moves at a time: held rows are looked at again once a day, and a
# held event stays deduplicated for about this long (up to the end of that UTC day) after
# its work finished.
HOLD_STEP = timedelta(days=1)


# Partitions are locked and dropped in the order the receiver and the workers lock the parents.
DROP_ORDER = {"receipts": 0, "deliveries": 1, "attempts": 2}


_MOVE_ORDER = tuple(DROP_ORDER)


_UNFINISHED = ", ".join(f"'{s}'" for s in UNFINISHED)


# A delivery that holds its receipt at :now. A dead letter without dead_at (none should exist:
# the migration backfilled it and every transition to dead sets it) is kept, not guessed at.
def holding(alias: str = "") -> str:
    d = f"{alias}." if alias else ""
    return (
        f"({d}status IN ({_UNFINISHED}) OR ({d}status = 'dead' AND ({d}dead_at IS NULL"
        f" OR {d}dead_at > CAST(:now AS timestamptz) - :retention)))"
    )


HOLDING = holding()


MICROSECOND = timedelta(microseconds=1)


@dataclass
class Holds:
    """What the hold step did in one run."""

    receipts: int = 0  # held receipts moved forward
    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_MOVE_ORDER, 0))
    # Partition mode: days not dropped because a delivery in them has a live lease.
    # Delete mode: receipts not moved (nor deleted) for the same reason.
    postponed: list[str] = field(default_factory=list)
    leased: int = 0  # deliveries with a live lease that caused those postponements
    dead_letters_expired: int = 0  # dead letters whose retention was over, removed

    def add_moved(self, moved: dict[str, int]) -> None:
        for table, n in moved.items():
            self.moved[table] += n


def hold_end(now: datetime) -> datetime:
    """Where a receipt held at ``now`` moves: the last instant of the UTC day ``HOLD_STEP``
    ahead. Not ``now + HOLD_STEP`` itself: a partition is dropped (and its held rows moved
    again) only once its whole day is past, so a receipt expiring mid-day would stop
    deduplicating for the rest of that day while still held."""
    _, upper = partitions.day_bounds((now + HOLD_STEP).astimezone(UTC).date())
    return upper - MICROSECOND


def decision_time(conn: Connection, now: datetime | None) -> datetime:
    """The instant this transaction decides at: the database's clock unless a test pinned
    one. Read after the layout lock, never before: a creator that waited for a dropper then
    sees the dropper's days as past too."""
    if now is not None:
        return now
    found: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
    return found


def database_now(engine: Engine) -> datetime:
    """The database's clock now (for reports; decisions read it in their own transaction)."""
    with engine.connect() as conn:
        return decision_time(conn, None)


def count_discarded(n: int, via: str) -> None:
    if n:
        # Imported here: a worker must choose prometheus' multi-process mode before the
        # metrics module is first imported, and this module is imported early.
        from core.metrics import DEAD_LETTERS_DISCARDED  # noqa: PLC0415 (see above)

        DEAD_LETTERS_DISCARDED.labels(via=via).inc(n)


# Per receipt (at most :batch of them, after receipt :after) whose expired deliveries include
# one that holds it: its deliveries locked (a concurrent claim, replay or finish either
# committed first, and is seen, or waits for us), whether one of them runs under a live
# lease, and where its hold ends (:data:`HOLD_UNTIL`). The candidates come from the two
# partial indexes (unfinished; dead), never from a scan of the expired rows.
HELD_SQL = f"""
    WITH holding AS (
        SELECT receipt_id, expires_at FROM {{deliveries}}
        WHERE expires_at <= CAST(:now AS timestamptz) AND status IN ({_UNFINISHED})
          AND receipt_id > :after
        UNION
        SELECT receipt_id, expires_at FROM {{deliveries}}
        WHERE expires_at <= CAST(:now AS timestamptz) AND status = 'dead'
          AND dead_at > CAST(:now AS timestamptz) - :retention AND receipt_id > :after
        UNION
        SELECT receipt_id, expires_at FROM {{deliveries}}
        WHERE expires_at <= CAST(:now AS timestamptz) AND status = 'dead' AND dead_at IS NULL
          AND receipt_id > :after
    ), batch AS (
        SELECT receipt_id, expires_at FROM holding ORDER BY receipt_id, expires_at LIMIT :batch
    ), locked AS MATERIALIZED (
        SELECT d.receipt_id, d.expires_at, d.status, d.dead_at, d.lease_until, d.next_attempt_at
        FROM {{deliveries}} d JOIN batch h
          ON d.receipt_id = h.receipt_id AND d.expires_at = h.expires_at
        ORDER BY d.id
        FOR UPDATE OF d
    )
    SELECT receipt_id, expires_at,
           count(*) FILTER (WHERE status = 'processing'
                              AND lease_until > CAST(:now AS timestamptz)) AS leased,
           {{hold_until}} AS hold_until
    FROM locked
    GROUP BY receipt_id, expires_at
    HAVING bool_or({HOLDING})
    ORDER BY receipt_id
"""  # noqa: S608 (literals of this module; the leaf name is quoted where it is filled in)


# Where a held receipt moves: the day its hold ends, so it moves once.
# - Unfinished work: the next day, or the day its next attempt is due when that is later
#   (a retry due in three days moves once, not three times); the last instant of that UTC
#   day, so it deduplicates until the day is dropped.
# - A dead letter: the end of its retention, ``dead_at + dead_letter_retention`` (a dead
#   letter without dead_at is kept like unfinished work, never guessed at).
# With both, the later of the two: the receipt moves once, to where every hold has ended.
_END_OF_DAY = "date_trunc('day', {at}, 'UTC') + interval '1 day' - interval '1 microsecond'"


_UNFINISHED_UNTIL = _END_OF_DAY.format(
    at=(
        "greatest(CAST(:now AS timestamptz) + :step, max(next_attempt_at)"
        f" FILTER (WHERE status IN ({_UNFINISHED})))"
    )
)


HOLD_UNTIL = f"""greatest(
    CASE WHEN bool_or(status IN ({_UNFINISHED}) OR (status = 'dead' AND dead_at IS NULL))
         THEN {_UNFINISHED_UNTIL} END,
    max(dead_at) FILTER (WHERE status = 'dead') + :retention)"""


# The moves, on the parents (a cross-partition row move in partition mode, in place in the
# DEFAULT partition in delete mode). Each names the old expires_at and the range it lies in,
# so only the expired partition is read; no status is touched (a worker's finishing
# statement names expires_at, which is why a row under a live lease waits: see
# :func:`models.retention_expiry._move_day`).
_MOVE_RECEIPTS = """
    UPDATE receipts AS r SET expires_at = h.hold_until
    FROM unnest(CAST(:ids AS bigint[]), CAST(:olds AS timestamptz[]),
                CAST(:news AS timestamptz[])) AS h(id, old, hold_until)
    WHERE r.id = h.id AND r.expires_at = h.old AND r.expires_at BETWEEN :lo AND :last
"""


_MOVE_DELIVERIES = """
    UPDATE deliveries AS d SET expires_at = h.hold_until
    FROM unnest(CAST(:ids AS bigint[]), CAST(:olds AS timestamptz[]),
                CAST(:news AS timestamptz[])) AS h(id, old, hold_until)
    WHERE d.receipt_id = h.id AND d.expires_at = h.old AND d.expires_at BETWEEN :lo AND :last
    RETURNING d.id, h.old, h.hold_until
"""


_MOVE_ATTEMPTS = """
    UPDATE attempts AS a SET expires_at = h.hold_until
    FROM unnest(CAST(:ids AS bigint[]), CAST(:olds AS timestamptz[]),
                CAST(:news AS timestamptz[])) AS h(id, old, hold_until)
    WHERE a.delivery_id = h.id AND a.expires_at = h.old AND a.expires_at BETWEEN :lo AND :last
"""


# Held receipts moved per transaction: each batch is its own short transaction holding row
# locks only, so no accept waits for it and a worker's finish waits at most one batch.
MOVE_BATCH = 2_000


@dataclass(frozen=True)
class Held:
    receipt_id: int
    expires_at: datetime
    leased: int
    hold_until: datetime


def held_receipts(
    conn: Connection,
    deliveries: str,
    now: datetime,
    settings: Settings,
    *,
    after: int = 0,
    batch: int = MOVE_BATCH,
) -> list[Held]:
    sql = HELD_SQL.format(deliveries=partitions.quote(conn, deliveries), hold_until=HOLD_UNTIL)
    rows = conn.execute(
        text(sql),
        {
            "now": now,
            "retention": settings.dead_letter_retention,
            "step": HOLD_STEP,
            "after": after,
            "batch": batch,
        },
    ).all()
    return [Held(int(r[0]), r[1], int(r[2]), r[3]) for r in rows]


def move_held(conn: Connection, held: list[Held], lo: datetime, last: datetime) -> dict[str, int]:
    """Move held receipts, all their deliveries and all their attempts to ``hold_until``."""
    moved = dict.fromkeys(_MOVE_ORDER, 0)
    if not held:
        return moved
    bounds = {"lo": lo, "last": last}
    receipts = {
        "ids": [h.receipt_id for h in held],
        "olds": [h.expires_at for h in held],
        "news": [h.hold_until for h in held],
    }
    moved["receipts"] = conn.execute(text(_MOVE_RECEIPTS), {**receipts, **bounds}).rowcount
    rows = conn.execute(text(_MOVE_DELIVERIES), {**receipts, **bounds}).all()
    moved["deliveries"] = len(rows)
    if rows:
        deliveries = {
            "ids": [int(r[0]) for r in rows],
            "olds": [r[1] for r in rows],
            "news": [r[2] for r in rows],
        }
        moved["attempts"] = conn.execute(text(_MOVE_ATTEMPTS), {**deliveries, **bounds}).rowcount
    return moved


def log_holds(holds: Holds) -> None:
    if holds.receipts:
        log.info(
            "rows_held", held=holds.receipts, **{f"{t}_moved": n for t, n in holds.moved.items()}
        )
    if holds.dead_letters_expired:
        log.info("dead_letters_expired", count=holds.dead_letters_expired)
        count_discarded(holds.dead_letters_expired, "retention")
