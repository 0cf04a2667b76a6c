"""Expiry maintenance, run by beat (each run idempotent, safe to overlap or miss).

- ``partition`` mode: create daily partitions ahead, through the longest TTL of the existing
  sources (:func:`ensure_partitions`), drop the ones wholly past (:func:`expire_partitions`):
  a catalog operation, no row scan; and drop the empty days laid out beyond what the sources
  need (:func:`trim_layout`), which every accept's duplicate probe would otherwise open.
- ``delete`` mode: :func:`delete_expired` deletes expired rows in batches of at most
  ``delete_batch_size`` (<= 10,000) rows per statement, each batch its own short transaction.
- both: :func:`drop_payloads` drops bodies past their retention; conflicts (not partitioned)
  are deleted in batches.

A receipt is expired from ``now >= expires_at`` (the receiver deduplicates while
``now < expires_at``), so every "expired" test below is ``expires_at <= now``.

Holds: expiry ends deduplication, never work. A delivery that is pending, retrying or
processing, or dead within ``dead_letter_retention`` of its ``dead_at``, *holds* its receipt:
before rows are removed, each held receipt, all its deliveries and all their attempts are
moved forward (``expires_at`` set to :func:`hold_end`, the last instant of the UTC day
``HOLD_STEP`` ahead, or to the end of the dead letters' retention when that comes sooner and
nothing is unfinished). A held receipt therefore keeps deduplicating its event; it is looked
at again when its new day is past (the first run after midnight UTC). The scan
for holds reads the partial indexes ``ix_deliveries_due`` (unfinished) and
``ix_deliveries_dead``, so a day whose work all succeeded is still dropped without a scan.

Time: every expiry decision is taken on the database's clock. ``now`` is None in production
(read with ``clock_timestamp()`` inside the deciding transaction, after the layout lock, so a
creator and a dropper serialised by that lock agree on which days are past); a test passes
an instant (:func:`core.clock.pinned`).

Only counts are logged, never ids or bodies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text

from core.logs import get_logger
from core.settings import Settings
from core.ttl import (
    MAX_EVENT_TIME_LEAD,
    TtlConfigError,
    TtlOverrides,
    dedup_terms,
    effective_ttl,
    known_providers,
)
from models import partitions
from models.schema import UNFINISHED_STATES

log = get_logger("retention")

# How far a held receipt moves at a time: held rows are looked at again once a day, and a
# held event stays deduplicated for about this long (up to the end of that UTC day) after
# its work finished.
HOLD_STEP = timedelta(days=1)

# Deliveries first, then the attempts and receipts none of them needs any more: each later
# step refuses rows whose delivery is still there (held, or re-held by a racing replay).
EXPIRING_TABLES = ("deliveries", "attempts", "receipts", "conflicts")
# Partitions are locked and dropped in the order the receiver and the workers lock the parents.
_DROP_ORDER = {"receipts": 0, "deliveries": 1, "attempts": 2}
_MOVE_ORDER = tuple(_DROP_ORDER)

_UNFINISHED = ", ".join(f"'{s}'" for s in UNFINISHED_STATES)
# A delivery that holds its receipt at :now. A dead letter without dead_at (none should exist:
# the migration backfilled it and every transition to dead sets it) is kept, not guessed at.


def _holding(alias: str = "") -> str:
    d = f"{alias}." if alias else ""
    return (
        f"({d}status IN ({_UNFINISHED}) OR ({d}status = 'dead' AND ({d}dead_at IS NULL"
        f" OR {d}dead_at > CAST(:now AS timestamptz) - :retention)))"
    )


_HOLDING = _holding()
# What the batched delete may remove: finished for good.
_REMOVABLE = (
    "(status IN ('succeeded', 'discarded') OR (status = 'dead' AND dead_at IS NOT NULL"
    " AND dead_at <= CAST(:now AS timestamptz) - :retention))"
)

_BEFORE_EVERYTHING = datetime.fromisoformat("0001-01-01T00:00:00+00:00")
_US = timedelta(microseconds=1)


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


@dataclass
class Expiry:
    """One partition-mode expiry pass."""

    now: datetime
    dropped: list[str] = field(default_factory=list)
    holds: Holds = field(default_factory=Holds)


@dataclass
class MaintenanceReport:
    mode: str
    now: datetime
    partitions_created: list[str] = field(default_factory=list)
    partitions_dropped: list[str] = field(default_factory=list)
    # Empty days beyond what the existing sources need, detached and dropped (trim_layout).
    partitions_trimmed: list[str] = field(default_factory=list)
    partitions_through: date | None = None  # last day laid out (partition mode)
    rows_deleted: dict[str, int] = field(default_factory=dict)
    delete_statements: dict[str, int] = field(default_factory=dict)
    payloads_dropped: int = 0
    held_receipts: int = 0  # receipts (with their deliveries, attempts) moved forward
    rows_moved: dict[str, int] = field(default_factory=dict)
    postponed: list[str] = field(default_factory=list)  # days (or receipts) left for later
    dead_letters_expired: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def add_holds(self, holds: Holds) -> None:
        self.held_receipts = holds.receipts
        self.rows_moved = dict(holds.moved)
        self.postponed = list(holds.postponed)
        self.dead_letters_expired = holds.dead_letters_expired


@dataclass
class DeleteCounts:
    rows: dict[str, int] = field(default_factory=dict)
    statements: dict[str, int] = field(default_factory=dict)
    holds: Holds = field(default_factory=Holds)


def hold_end(now: datetime) -> datetime:
    """Where a receipt held at ``now`` moves: the last instant of the UTC day ``HOLD_STEP``
    ahead. Not ``now + HOLD_STEP`` itself: a partition is dropped (and its held rows moved
    again) only once its whole day is past, so a receipt expiring mid-day would stop
    deduplicating for the rest of that day while still held."""
    _, upper = partitions.day_bounds((now + HOLD_STEP).astimezone(UTC).date())
    return upper - _US


def _decision_time(conn: Connection, now: datetime | None) -> datetime:
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
        return _decision_time(conn, None)


def _count_discarded(n: int, via: str) -> None:
    if n:
        # Imported here: a worker must choose prometheus' multi-process mode before the
        # metrics module is first imported, and this module is imported early.
        from core.metrics import DEAD_LETTERS_DISCARDED  # noqa: PLC0415

        DEAD_LETTERS_DISCARDED.labels(via=via).inc(n)


# ----------------------------------------------------------------------------------------
# Partitions
# ----------------------------------------------------------------------------------------


def longest_ttl(engine: Engine, settings: Settings) -> timedelta:
    """The longest TTL a receipt of any existing source is written with (the effective one,
    raised when the source's terms no longer cover its retry window); zero with no source.

    Only sources count, never every installed provider: the accept statement's live-receipt
    probe opens each day laid out from yesterday on, so a provider nobody uses (Adyen's 30-day
    window) must not stretch the layout every accept pays for (issue 24). A source added later
    lays out its own days (``webhooks sources add`` / ``update``), and a receipt that finds no
    partition makes the receiver lay one out and retry (:func:`ensure_partitions`)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT DISTINCT provider, retry_window_s, queue_lag_s, clock_skew_s,"
                " replay_grace_s FROM sources"
            )
        ).all()
    longest = timedelta(0)
    for provider, *seconds in rows:
        try:
            ttl = effective_ttl(provider, TtlOverrides.from_seconds(*seconds), settings)
        except TtlConfigError:
            continue  # refused by the receiver too: it never writes a receipt
        longest = max(longest, ttl.total)
    return longest


def _longest_provider_default(settings: Settings) -> timedelta:
    """The longest TTL any installed provider gives a source with default terms: how far the
    layout reached before it counted only existing sources (the bound of :func:`trim_layout`)."""
    return max(
        (dedup_terms(p, TtlOverrides(), settings).total for p in known_providers()),
        default=timedelta(0),
    )


def _layout_end(at: datetime, longest: timedelta, settings: Settings) -> date:
    """The last day :func:`ensure_partitions` lays out at ``at`` for TTLs up to ``longest``."""
    horizon = at + longest + MAX_EVENT_TIME_LEAD
    return (horizon + timedelta(days=settings.partition_ahead_days)).date()


def ensure_partitions(engine: Engine, settings: Settings, now: datetime | None) -> list[str]:
    """Lay out the partitions receipts written from ``now`` on can need; returns those created.

    Days run from yesterday through ``now + longest TTL + MAX_EVENT_TIME_LEAD +
    partition_ahead_days``, skipping any day wholly past (upper bound <= now): the expiry
    would only drop it again. ``now`` None: the database's clock, read under the layout
    lock, so a host whose clock lags can never lay out a day maintenance has passed.
    In ``delete`` mode it makes sure the DEFAULT partitions exist instead.
    """
    if settings.retention_mode == "delete":
        with engine.begin() as conn:
            partitions.lock_layout(conn)
            partitions.create_default(conn)
        return []
    longest = longest_ttl(engine, settings)
    created: list[str] = []
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        at = _decision_time(conn, now)
        last = _layout_end(at, longest, settings)
        existing = {p.name for p in partitions.list_partitions(conn)}
        day = (at - timedelta(days=1)).date()
        while day <= last:
            _, upper = partitions.day_bounds(day)
            names = [partitions.partition_name(t, day) for t in _DROP_ORDER]
            if upper > at and not existing.issuperset(names):
                partitions.create_day(conn, day)
                created += [n for n in names if n not in existing]
            day += timedelta(days=1)
    if created:
        log.info("partitions_created", count=len(created), through=last.isoformat())
    return created


def trim_layout(engine: Engine, settings: Settings, now: datetime | None) -> list[str]:
    """Detach and drop the days laid out beyond what the existing sources need that hold no
    row (partition mode); returns the leaves dropped.

    The accept's live-receipt probe opens every day from yesterday on, so each empty day ahead
    costs every accept (issue 24: a layout sized by every installed provider, 41 days where the
    sources needed 14). Only days after :func:`ensure_partitions`' last day and up to the last
    day the former layout reached (the longest default TTL of any installed provider) are
    looked at: a day further out was made for a reason of its own (a long-TTL receipt on
    demand, a dead letter's hold) and goes when it has passed, like any other.

    Nothing deduplicating is ever removed: each day is detached first (``DETACH ...
    CONCURRENTLY``, under the layout lock held for the session, so no creator races it), and
    dropped only if all its leaves are still empty once detached; a row that landed before
    the detach puts the day back, untouched. An accept that arrives after the detach finds no
    partition and makes the receiver lay the day out again (the layout lock waits for us)."""
    if settings.retention_mode == "delete":
        return []
    dropped: list[str] = []
    with engine.connect() as base:
        conn = base.execution_options(isolation_level="AUTOCOMMIT")
        partitions.lock_layout_session(conn)
        try:
            # Under the lock: a source added meanwhile has laid out its days already.
            longest = longest_ttl(engine, settings)
            at = _decision_time(conn, now)
            last = _layout_end(at, longest, settings)
            bound = _layout_end(at, max(longest, _longest_provider_default(settings)), settings)
            days: dict[date, list[partitions.Partition]] = {}
            for p in partitions.list_partitions(conn):
                if p.lower is None or p.table not in _DROP_ORDER:
                    continue
                day = p.lower.astimezone(UTC).date()
                if last < day <= bound:
                    days.setdefault(day, []).append(p)
            for day in sorted(days):
                leaves = sorted(days[day], key=lambda p: _DROP_ORDER[p.table])
                if _drop_if_empty(conn, leaves):
                    dropped += [p.name for p in leaves]
        finally:
            partitions.unlock_layout_session(conn)
    if dropped:
        log.info("partitions_trimmed", count=len(dropped))
    return dropped


def _drop_if_empty(conn: Connection, leaves: list[partitions.Partition]) -> bool:
    """One day of :func:`trim_layout`: a cheap look first (most days hold rows or none),
    then detach, look again on the detached leaves (nothing can reach them any more), and
    drop them or attach them back."""
    if not all(_empty(conn, p.name) for p in leaves):
        return False
    detached: list[partitions.Partition] = []
    try:
        for leaf in leaves:
            partitions.detach(conn, leaf)
            detached.append(leaf)
    except Exception:
        _restore(conn, detached)
        raise
    if not all(_empty(conn, p.name) for p in leaves):
        for leaf in leaves:
            partitions.reattach(conn, leaf)
        return False
    for leaf in leaves:
        partitions.drop(conn, leaf)
    return True


def _empty(conn: Connection, leaf: str) -> bool:
    found = conn.execute(
        text(f"SELECT EXISTS (SELECT 1 FROM {partitions.quote(conn, leaf)})")  # noqa: S608
    ).scalar_one()
    return not found


# Per receipt (at most :batch of them, after receipt :after) whose expired deliveries include
# one that holds it: its deliveries locked (a concurrent claim, replay or finish either
# committed first, and is seen, or waits for us), whether one of them runs under a live
# lease, and where its hold ends (:data:`_HOLD_UNTIL`). The candidates come from the two
# partial indexes (unfinished; dead), never from a scan of the expired rows.
_HELD_SQL = f"""
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
    HAVING bool_or({_HOLDING})
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
_HOLD_UNTIL = f"""greatest(
    CASE WHEN bool_or(status IN ({_UNFINISHED}) OR (status = 'dead' AND dead_at IS NULL))
         THEN {_UNFINISHED_UNTIL} END,
    max(dead_at) FILTER (WHERE status = 'dead') + :retention)"""

# The moves, on the parents (a cross-partition row move in partition mode, in place in the
# DEFAULT partition in delete mode). Each names the old expires_at and the range it lies in,
# so only the expired partition is read; no status is touched (a worker's finishing
# statement names expires_at, which is why a row under a live lease waits: see
# :func:`_move_day`).
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
class _Held:
    receipt_id: int
    expires_at: datetime
    leased: int
    hold_until: datetime


@dataclass(frozen=True)
class LeaseWait:
    """How the drop waits for rows under a live lease (injected by tests): ``sleep`` between
    looks, and ``monotonic`` to end the wait once the longest lease seen has run out."""

    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic
    poll: float = 0.5


def _held(
    conn: Connection,
    deliveries: str,
    now: datetime,
    settings: Settings,
    *,
    after: int = 0,
    batch: int = MOVE_BATCH,
) -> list[_Held]:
    sql = _HELD_SQL.format(deliveries=partitions.quote(conn, deliveries), hold_until=_HOLD_UNTIL)
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
    return [_Held(int(r[0]), r[1], int(r[2]), r[3]) for r in rows]


def _move(conn: Connection, held: list[_Held], lo: datetime, last: datetime) -> dict[str, int]:
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


def _make_days(conn: Connection, held: list[_Held]) -> None:
    """Lay out the days the held rows move to that do not exist yet (a dead letter's lies
    up to ``dead_letter_retention`` ahead, past what maintenance lays out): attached, never
    locking out accepts (:func:`models.partitions.create_day`)."""
    days = {h.hold_until.astimezone(UTC).date() for h in held}
    existing = {p.name for p in partitions.list_partitions(conn)}
    missing = sorted(d for d in days if partitions.partition_name("receipts", d) not in existing)
    if missing:
        partitions.lock_layout(conn)
        for day in missing:
            partitions.create_day(conn, day)


def _move_batch(
    engine: Engine,
    settings: Settings,
    leaf: str,
    now: datetime | None,
    bounds: tuple[datetime, datetime],
    after: int,
    holds: Holds,
) -> tuple[list[_Held], datetime]:
    """One transaction: the next batch of held receipts after ``after``, those under no live
    lease moved. Returns the batch (leased ones included) and the instant it decided at."""
    with engine.begin() as conn:
        at = _decision_time(conn, now)
        held = _held(conn, leaf, at, settings, after=after)
        ready = [h for h in held if not h.leased]
        _make_days(conn, ready)
        holds.receipts += len(ready)
        holds.add_moved(_move(conn, ready, *bounds))
    return held, at


def _move_day(
    engine: Engine,
    settings: Settings,
    leaf: str,
    now: datetime | None,
    bounds: tuple[datetime, datetime],
    holds: Holds,
    wait: LeaseWait,
) -> bool:
    """Move every held receipt out of a past day's deliveries leaf before the day is
    detached, in batches of short transactions (row locks only: accepts never wait).

    A receipt with a delivery under a live lease is handled like the others, one step
    later: its worker's finishing statement names the row's ``expires_at``, so moving the
    row under it would lose the handler's outcome (and run it a second time). Once the
    first pass has moved the rest, the few leased receipts are looked at again until their
    worker has finished (the row is then moved, or goes with the day if nothing holds it
    any more) or their lease has run out. Only the leased rows wait, never the day's other
    rows, and no lock is held meanwhile. Returns False if a lease was still live after the
    longest lease seen (the row was claimed again): the day is left for the next run."""
    after, leased_until = 0, None
    while True:
        held, at = _move_batch(engine, settings, leaf, now, bounds, after, holds)
        leased_until = _longest_lease(held, at, leased_until, wait, settings)
        if len(held) < MOVE_BATCH:
            break
        after = held[-1].receipt_id
    while leased_until is not None:
        if wait.monotonic() >= leased_until:
            held, at = _move_batch(engine, settings, leaf, now, bounds, 0, holds)
            return not any(h.leased for h in held)
        wait.sleep(wait.poll)
        held, at = _move_batch(engine, settings, leaf, now, bounds, 0, holds)
        if not any(h.leased for h in held):
            return True
    return True


def _move_expired(
    engine: Engine,
    settings: Settings,
    leaf: str,
    now: datetime | None,
    bounds: tuple[datetime, datetime],
    holds: Holds,
) -> None:
    """One pass over a day not yet past: its held receipts already expired move to where
    their hold ends; one under a live lease stays for a later run (never waited for)."""
    after = 0
    while True:
        held, _ = _move_batch(engine, settings, leaf, now, bounds, after, holds)
        if len(held) < MOVE_BATCH:
            return
        after = held[-1].receipt_id


def _current_deliveries(
    layout: list[partitions.Partition], at: datetime
) -> list[partitions.Partition]:
    """The deliveries leaf of the day ``at`` lies in (if laid out)."""
    return [
        p
        for p in layout
        if p.table == "deliveries"
        and p.lower is not None
        and p.upper is not None
        and p.lower <= at < p.upper
        and not p.detach_pending
    ]


def _longest_lease(
    held: list[_Held],
    at: datetime,
    until: float | None,
    wait: LeaseWait,
    settings: Settings,
) -> float | None:
    """When (on ``wait.monotonic``) the leases seen so far have all run out: a lease lasts
    at most ``processing_ttl`` from ``at``."""
    if not any(h.leased for h in held):
        return until
    end = wait.monotonic() + settings.processing_ttl
    return end if until is None else max(until, end)


def _detach_and_drop(
    engine: Engine, settings: Settings, leaves: list[partitions.Partition], now: datetime | None
) -> bool:
    """Take a past day out of its parents without blocking them, then drop it.

    ``DETACH PARTITION ... CONCURRENTLY`` per leaf (autocommit, under the layout lock held
    for the session): accepts and workers on other days never wait. Once detached, nobody
    can reach the day through the parents; if a row in it became held after the moves
    (a replay raced them), the day is attached again, untouched, and left for the next run.
    Otherwise ``DROP TABLE`` takes only the detached tables. Returns whether it dropped."""
    with engine.connect() as base:
        conn = base.execution_options(isolation_level="AUTOCOMMIT")
        partitions.lock_layout_session(conn)
        try:
            detached: list[partitions.Partition] = []
            try:
                for leaf in leaves:
                    partitions.detach(conn, leaf)
                    detached.append(leaf)
            except Exception:
                _restore(conn, detached)
                raise
            deliveries = [p for p in leaves if p.table == "deliveries"]
            if deliveries and _holds_any(conn, deliveries[0].name, now, settings):
                for leaf in leaves:
                    partitions.reattach(conn, leaf)
                return False
            for leaf in leaves:
                partitions.drop(conn, leaf)
            return True
        finally:
            partitions.unlock_layout_session(conn)


def _restore(conn: Connection, detached: list[partitions.Partition]) -> None:
    """A detach failed part way (its timeout): attach again the leaves already out, so the
    day stays whole and listed; the one left pending is finished by the next run."""
    for leaf in detached:
        try:
            partitions.reattach(conn, leaf)
        except Exception as exc:  # noqa: BLE001  (the detach's error is the one raised)
            log.warning("partition_reattach_failed", error_class=type(exc).__name__)


def _holds_any(conn: Connection, leaf: str, now: datetime | None, settings: Settings) -> bool:
    at = _decision_time(conn, now)
    found = conn.execute(
        text(f"SELECT 1 FROM {partitions.quote(conn, leaf)} WHERE {_HOLDING} LIMIT 1"),  # noqa: S608
        {"now": at, "retention": settings.dead_letter_retention},
    ).first()
    return found is not None


def _dead_letters_in(engine: Engine, leaf: str) -> int:
    """Dead letters still in a day about to go: all past their retention (the others moved)."""
    with engine.connect() as conn:
        name = partitions.quote(conn, leaf)
        found = conn.execute(
            text(f"SELECT count(*) FROM {name} WHERE status = 'dead'")  # noqa: S608
        ).scalar_one()
    return int(found)


def _past_days(
    layout: list[partitions.Partition], at: datetime
) -> list[tuple[datetime, list[partitions.Partition]]]:
    """Each day whose partitions are wholly past at ``at``, oldest first, with its leaves in
    the order the receiver and the workers lock the parents."""
    days: dict[tuple[datetime, datetime], list[partitions.Partition]] = {}
    for p in layout:
        if p.lower is None or p.upper is None or p.table not in _DROP_ORDER:
            continue  # DEFAULT partitions have no bound: never dropped
        if p.upper <= at:
            days.setdefault((p.lower, p.upper), []).append(p)
    return [
        (lower, sorted(leaves, key=lambda p: _DROP_ORDER[p.table]))
        for (lower, _), leaves in sorted(days.items())
    ]


def expire_partitions(
    engine: Engine, settings: Settings, now: datetime | None, *, wait: LeaseWait | None = None
) -> Expiry:
    """Drop every partition of receipts, deliveries and attempts whose upper bound is <= now,
    after moving the rows it holds out of it.

    Safe by construction: Postgres enforces ``expires_at < upper`` for every row of a range
    partition, so ``upper <= now`` means every row in it has ``expires_at < now``: expired.
    A partition holding a receipt with ``expires_at > now`` has ``upper > expires_at > now``
    and is never chosen. The bounds come from the catalog, not from the partition's name;
    DEFAULT partitions have no bound and are never dropped.

    Held rows of the current day whose ``expires_at`` has passed move at every run (they are
    held, so they move once, like the others): maintenance runs every few minutes, so the
    moves are spread over the day and the drop after midnight has few left.

    Per past day, nothing ever blocks an accept or a worker on another day:
    1. its held receipts move, with their deliveries and attempts, to the day their hold
       ends (:data:`_HOLD_UNTIL`: once, not day after day), in short batches taking row
       locks only; a row under a live lease moves once its worker has finished
       (:func:`_move_day`);
    2. its leaves are detached concurrently and dropped (:func:`_detach_and_drop`).
    """
    if settings.retention_mode == "delete":
        return Expiry(now=now or database_now(engine))
    wait = wait or LeaseWait()
    holds = Holds()
    dropped: list[partitions.Partition] = []
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        at = _decision_time(conn, now)
        layout = partitions.list_partitions(conn)
        days = _past_days(layout, at)
    for today in _current_deliveries(layout, at):
        # Held rows of today that expired since the last run move now, a few at a time,
        # so the drop after midnight finds only the last minutes' (and no lease waits).
        assert today.lower is not None
        assert today.upper is not None
        _move_expired(engine, settings, today.name, now, (today.lower, today.upper - _US), holds)
    for lower, leaves in days:
        day = lower.date().isoformat()
        deliveries = [p for p in leaves if p.table == "deliveries"]
        if deliveries and not deliveries[0].detach_pending:
            assert deliveries[0].upper is not None
            bounds = (lower, deliveries[0].upper - _US)
            if not _move_day(engine, settings, deliveries[0].name, now, bounds, holds, wait):
                holds.postponed.append(day)
                log.info("partition_drop_postponed", day=day, reason="lease")
                continue
            expired_dead = _dead_letters_in(engine, deliveries[0].name)
        else:
            expired_dead = 0
        if not _detach_and_drop(engine, settings, leaves, now):
            holds.postponed.append(day)
            log.info("partition_drop_postponed", day=day, reason="held_after_moves")
            continue
        holds.dead_letters_expired += expired_dead
        dropped += leaves
    _log_holds(holds)
    if dropped:
        log.info("partitions_dropped", count=len(dropped))
    return Expiry(now=at, dropped=[p.name for p in dropped], holds=holds)


def drop_expired_partitions(engine: Engine, settings: Settings, now: datetime | None) -> list[str]:
    """:func:`expire_partitions`, returning only the names of the partitions dropped."""
    return expire_partitions(engine, settings, now).dropped


def _log_holds(holds: Holds) -> None:
    if holds.receipts:
        log.info(
            "rows_held", held=holds.receipts, **{f"{t}_moved": n for t, n in holds.moved.items()}
        )
    if holds.dead_letters_expired:
        log.info("dead_letters_expired", count=holds.dead_letters_expired)
        _count_discarded(holds.dead_letters_expired, "retention")


# ----------------------------------------------------------------------------------------
# Batched delete
# ----------------------------------------------------------------------------------------


def hold_in_place(
    engine: Engine, settings: Settings, now: datetime | None
) -> tuple[datetime, Holds]:
    """Delete mode's hold step: move held expired receipts (with their deliveries and
    attempts) in the DEFAULT partitions to where their hold ends (:data:`_HOLD_UNTIL`), in
    batches of short transactions; a receipt with a delivery under a live lease is left for
    a later run, whole (the batched delete refuses its siblings too). Returns the decision
    instant."""
    holds = Holds()
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        at = _decision_time(conn, now)
        deliveries = [p.name for p in partitions.list_partitions(conn) if p.table == "deliveries"]
    for leaf in deliveries:
        after = 0
        while True:
            with engine.begin() as conn:
                held = _held(conn, leaf, at, settings, after=after)
                ready = [h for h in held if not h.leased]
                holds.receipts += len(ready)
                holds.add_moved(_move(conn, ready, _BEFORE_EVERYTHING, at))
            for h in held:
                if h.leased:
                    holds.postponed.append(f"receipt {h.receipt_id}")
                    holds.leased += h.leased
            if len(held) < MOVE_BATCH:
                break
            after = held[-1].receipt_id
    if holds.leased:
        log.info("receipt_hold_postponed", receipts=len(holds.postponed), count=holds.leased)
    return at, holds


# The predicate of each table's batch: expired, and no longer needed. Deliveries go when
# finished for good; attempts and receipts when no delivery of theirs is left (so a delivery
# a replay revived between two steps keeps its attempts and its receipt).
_DELETABLE = {
    # Nor a delivery whose receipt is still held by a sibling (a receipt the hold step left
    # for a live lease): the receipt keeps all its deliveries and their attempts.
    "deliveries": (
        f"{_REMOVABLE} AND NOT EXISTS (SELECT 1 FROM deliveries s"  # noqa: S608 (literals)
        " WHERE s.receipt_id = {leaf}.receipt_id AND s.expires_at = {leaf}.expires_at"
        f" AND {_holding('s')})"
    ),
    "attempts": (
        "NOT EXISTS (SELECT 1 FROM deliveries d"
        " WHERE d.id = {leaf}.delivery_id AND d.expires_at = {leaf}.expires_at)"
    ),
    "receipts": (
        "NOT EXISTS (SELECT 1 FROM deliveries d"
        " WHERE d.receipt_id = {leaf}.id AND d.expires_at = {leaf}.expires_at)"
    ),
    "conflicts": "true",
}


def _delete_statement(conn: Connection, table: str, leaf: str) -> Any:
    """One batch on one leaf table, found oldest first (expires_at is indexed there) and
    deleted by ctid: a TID lookup per row, never a scan of the table. A ctid is unique only
    within one table, so this runs per partition, never on a partitioned parent; the outer
    predicate repeats the whole test (a row changed since the inner select is re-checked),
    so a row can never be deleted unexpired or held. Deliveries return whether each was a
    dead letter, to count those whose retention ended."""
    name = partitions.quote(conn, leaf)
    keep = _DELETABLE[table].format(leaf=name)
    returning = " RETURNING status = 'dead'" if table == "deliveries" else ""
    return text(
        f"DELETE FROM {name} WHERE ctid = ANY(ARRAY("  # noqa: S608 (catalog names, quoted)
        f" SELECT ctid FROM {name} WHERE expires_at <= :now AND {keep}"
        f" ORDER BY expires_at LIMIT :limit"
        f")) AND expires_at <= :now AND {keep}{returning}"
    )


def _leaves(conn: Connection, table: str) -> list[str]:
    if table in _DROP_ORDER:
        return [p.name for p in partitions.list_partitions(conn) if p.table == table]
    return [table]


def _delete_batched(
    engine: Engine, settings: Settings, table: str, now: datetime, batch: int
) -> tuple[int, int, int]:
    """Delete expired rows of one table, ``batch`` at most per statement, each statement in
    its own transaction, partition by partition; a partition is done at its first short
    batch. Returns (rows, statements, dead letters among the rows)."""
    with engine.connect() as conn:
        statements_by_leaf = [_delete_statement(conn, table, leaf) for leaf in _leaves(conn, table)]
    params = {"now": now, "limit": batch, "retention": settings.dead_letter_retention}
    rows = statements = dead = 0
    for statement in statements_by_leaf:
        while True:
            with engine.begin() as conn:
                result = conn.execute(statement, params)
                if table == "deliveries":
                    flags = result.scalars().all()
                    deleted = len(flags)
                    dead += sum(1 for f in flags if f)
                else:
                    deleted = result.rowcount
            statements += 1
            rows += deleted
            if deleted < batch:
                break
    return rows, statements, dead


def delete_expired(
    engine: Engine,
    settings: Settings,
    now: datetime | None,
    tables: tuple[str, ...] = EXPIRING_TABLES,
) -> DeleteCounts:
    """The batched-delete expiry (``delete`` mode; conflicts in both modes). When it expires
    deliveries, the hold step runs first, and the batches refuse held rows themselves too
    (a replay can race between the two)."""
    batch = min(settings.delete_batch_size, 10_000)
    counts = DeleteCounts()
    if "deliveries" in tables:
        at, counts.holds = hold_in_place(engine, settings, now)
    elif now is None:
        at = database_now(engine)
    else:
        at = now
    for table in tables:
        rows, statements, dead = _delete_batched(engine, settings, table, at, batch)
        counts.rows[table] = rows
        counts.statements[table] = statements
        counts.holds.dead_letters_expired += dead
    if any(counts.rows.values()):
        log.info("rows_deleted", **{t: n for t, n in counts.rows.items() if n})
    _log_holds(counts.holds)
    return counts


# ----------------------------------------------------------------------------------------
# Payload retention
# ----------------------------------------------------------------------------------------

# One batch: the next ``limit`` receipts (by received_at, id) that still hold a body and were
# received before the cutoff, their deliveries locked FOR SHARE (a concurrent replay or
# re-run either committed first, and we see its non-succeeded status, or waits for us), and
# the bodies of those whose every delivery succeeded at or before the cutoff dropped.
# A receipt without deliveries (no route matched) has nothing left to do: its age counts
# from its arrival. Dead, pending, retrying and processing deliveries keep the body.
_DROP_PAYLOADS = text(
    """
    WITH clock AS MATERIALIZED (
        SELECT coalesce(CAST(:now AS timestamptz), now()) AS now,
               coalesce(CAST(:now AS timestamptz), now()) - :retention AS cutoff
    ), candidate AS MATERIALIZED (
        SELECT id, expires_at, received_at FROM receipts
        WHERE payload IS NOT NULL AND received_at <= (SELECT cutoff FROM clock)
          AND (received_at, id) > (:after_received, :after_id)
        ORDER BY received_at, id
        LIMIT :limit
    ), locked AS MATERIALIZED (
        SELECT d.receipt_id, d.status, d.succeeded_at
        FROM deliveries d JOIN candidate c ON d.receipt_id = c.id AND d.expires_at = c.expires_at
        FOR SHARE OF d
    ), summary AS (
        SELECT receipt_id, bool_and(status = 'succeeded') AS all_succeeded,
               max(succeeded_at) AS last_succeeded
        FROM locked GROUP BY receipt_id
    ), done AS (
        SELECT c.id, c.expires_at FROM candidate c LEFT JOIN summary s ON s.receipt_id = c.id
        WHERE coalesce(s.all_succeeded, true)
          AND coalesce(s.last_succeeded, c.received_at) <= (SELECT cutoff FROM clock)
    ), dropped AS (
        UPDATE receipts r SET payload = NULL, payload_dropped_at = (SELECT now FROM clock)
        FROM done
        WHERE r.id = done.id AND r.expires_at = done.expires_at AND r.payload IS NOT NULL
        RETURNING r.id
    ), last AS (
        SELECT received_at, id FROM candidate ORDER BY received_at DESC, id DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM dropped), (SELECT count(*) FROM candidate),
           (SELECT received_at FROM last), (SELECT id FROM last)
    """
)


def drop_payloads(engine: Engine, settings: Settings, now: datetime | None) -> int:
    """Drop the bodies whose retention is over (see :data:`_DROP_PAYLOADS`); set
    ``payload_dropped_at``. Walks the candidates in keyset order, ``delete_batch_size`` per
    statement, so bodies that must stay (dead letters, work in flight) never stall the walk.
    ``now`` None: each statement decides on the database's clock. Returns how many bodies
    were dropped."""
    batch = min(settings.delete_batch_size, 10_000)
    after_received, after_id = _BEFORE_EVERYTHING, 0
    total = 0
    while True:
        with engine.begin() as conn:
            dropped, seen, last_received, last_id = conn.execute(
                _DROP_PAYLOADS,
                {
                    "retention": settings.payload_retention,
                    "now": now,
                    "limit": batch,
                    "after_received": after_received,
                    "after_id": after_id,
                },
            ).one()
        total += int(dropped)
        if seen < batch:
            break
        after_received, after_id = last_received, last_id
    if total:
        log.info("payloads_dropped", count=total)
    return total


# ----------------------------------------------------------------------------------------
# One maintenance run
# ----------------------------------------------------------------------------------------


def run_maintenance(engine: Engine, settings: Settings, now: datetime | None) -> MaintenanceReport:
    """One maintenance pass for ``settings.retention_mode`` (called by beat and the CLI).
    ``now`` None (production): every step decides on the database's clock."""
    # The report's instant (each step reads its own, under its own locks).
    report = MaintenanceReport(mode=settings.retention_mode, now=now or database_now(engine))
    if settings.retention_mode == "partition":
        report.partitions_created = ensure_partitions(engine, settings, now)
        expiry = expire_partitions(engine, settings, now)
        report.partitions_dropped = expiry.dropped
        report.partitions_trimmed = trim_layout(engine, settings, now)
        report.add_holds(expiry.holds)
        with engine.connect() as conn:
            uppers = [p.upper for p in partitions.list_partitions(conn) if p.upper is not None]
        if uppers:
            # The last day laid out, not the exclusive bound after it.
            report.partitions_through = (max(uppers) - timedelta(days=1)).date()
        counts = delete_expired(engine, settings, now, tables=("conflicts",))
    else:
        ensure_partitions(engine, settings, now)
        counts = delete_expired(engine, settings, now)
        report.add_holds(counts.holds)
    report.rows_deleted = counts.rows
    report.delete_statements = counts.statements
    report.payloads_dropped = drop_payloads(engine, settings, now)
    log.info(
        "maintenance",
        mode=report.mode,
        partitions_created=len(report.partitions_created),
        partitions_dropped=len(report.partitions_dropped),
        partitions_trimmed=len(report.partitions_trimmed),
        rows_deleted=sum(report.rows_deleted.values()),
        held_receipts=report.held_receipts,
        postponed=len(report.postponed),
        dead_letters_expired=report.dead_letters_expired,
        payloads_dropped=report.payloads_dropped,
    )
    return report
