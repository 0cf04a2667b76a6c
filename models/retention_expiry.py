"""Partition mode's expiry: a day wholly past has its held rows moved out
(:mod:`models.retention_holds`), then is detached concurrently and dropped
(:func:`expire_partitions`); a day under a live lease waits for its worker or is left for
the next run. The rules of expiry: :mod:`models.retention`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, text

from core.logs import get_logger
from core.settings import Settings
from models import ledger, partitions
from models.retention_holds import (
    DROP_ORDER,
    HOLDING,
    MICROSECOND,
    MOVE_BATCH,
    Held,
    Holds,
    database_now,
    decision_time,
    held_receipts,
    log_holds,
    move_held,
)
from models.retention_layout import detach_then_drop

log = get_logger("retention")


@dataclass
class Expiry:
    """One partition-mode expiry pass."""

    now: datetime
    dropped: list[str] = field(default_factory=list)
    holds: Holds = field(default_factory=Holds)


@dataclass(frozen=True)
class LeaseWait:
    """How the drop waits for rows under a live lease (injected by tests): ``sleep`` between
    looks, and ``monotonic`` to end the wait once the longest lease seen has run out."""

    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic
    poll: float = 0.5


def _make_days(conn: Connection, held: list[Held]) -> None:
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
) -> tuple[list[Held], datetime]:
    """One transaction: the next batch of held receipts after ``after``, those under no live
    lease moved. Returns the batch (leased ones included) and the instant it decided at."""
    with engine.begin() as conn:
        at = decision_time(conn, now)
        held = held_receipts(conn, leaf, at, settings, after=after)
        ready = [h for h in held if not h.leased]
        _make_days(conn, ready)
        holds.receipts += len(ready)
        holds.add_moved(move_held(conn, ready, *bounds))
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
    held: list[Held],
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


def _retire_filtered(engine: Engine, settings: Settings, leaves: list[partitions.Partition]) -> int:
    """Before a past day goes: delete its deliveries filtered at the accept, appending their
    ledger rows in the same statements (:func:`models.ledger.deleting`), in batches of short
    transactions. The accept writes none for them (migration 0035), and the day's drop would
    take them with it unrecorded; deleting them here records each once, whatever happens to
    the drop afterwards. Returns how many were recorded."""
    tables = {p.table: p.name for p in leaves}
    if "deliveries" not in tables or "receipts" not in tables:
        return 0
    batch = min(settings.delete_batch_size, 10_000)
    with engine.connect() as conn:
        deliveries = partitions.quote(conn, tables["deliveries"])
        statement = text(
            ledger.deleting(
                f"DELETE FROM {deliveries} WHERE ctid = ANY(ARRAY("  # noqa: S608 (catalog names)
                f" SELECT ctid FROM {deliveries} WHERE {ledger.FILTERED_AT_ACCEPT}"
                f" LIMIT :limit)) AND {ledger.FILTERED_AT_ACCEPT}",
                partitions.quote(conn, tables["receipts"]),
                "1",
            )
        )
    retired = 0
    while True:
        with engine.begin() as conn:
            deleted = len(conn.execute(statement, {"limit": batch}).all())
        retired += deleted
        if deleted < batch:
            return retired


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
            deliveries = [p for p in leaves if p.table == "deliveries"]
            return detach_then_drop(
                conn,
                leaves,
                keep=lambda: (
                    bool(deliveries) and _holds_any(conn, deliveries[0].name, now, settings)
                ),
            )
        finally:
            partitions.unlock_layout_session(conn)


def _holds_any(conn: Connection, leaf: str, now: datetime | None, settings: Settings) -> bool:
    at = decision_time(conn, now)
    found = conn.execute(
        text(f"SELECT 1 FROM {partitions.quote(conn, leaf)} WHERE {HOLDING} LIMIT 1"),  # noqa: S608
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
        if p.lower is None or p.upper is None or p.table not in DROP_ORDER:
            continue  # DEFAULT partitions have no bound: never dropped
        if p.upper <= at:
            days.setdefault((p.lower, p.upper), []).append(p)
    return [
        (lower, sorted(leaves, key=lambda p: DROP_ORDER[p.table]))
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
       ends (:data:`HOLD_UNTIL`: once, not day after day), in short batches taking row
       locks only; a row under a live lease moves once its worker has finished
       (:func:`_move_day`);
    2. its deliveries filtered at the accept are deleted, their ledger rows appended by the
       same statements (:func:`_retire_filtered`);
    3. its leaves are detached concurrently and dropped (:func:`_detach_and_drop`).
    """
    if settings.retention_mode == "delete":
        return Expiry(now=now or database_now(engine))
    wait = wait or LeaseWait()
    holds = Holds()
    dropped: list[partitions.Partition] = []
    with engine.begin() as conn:
        partitions.lock_layout(conn)
        at = decision_time(conn, now)
        layout = partitions.list_partitions(conn)
        days = _past_days(layout, at)
    for today in _current_deliveries(layout, at):
        # Held rows of today that expired since the last run move now, a few at a time,
        # so the drop after midnight finds only the last minutes' (and no lease waits).
        assert today.lower is not None
        assert today.upper is not None
        _move_expired(
            engine, settings, today.name, now, (today.lower, today.upper - MICROSECOND), holds
        )
    for lower, leaves in days:
        day = lower.date().isoformat()
        deliveries = [p for p in leaves if p.table == "deliveries"]
        if deliveries and not deliveries[0].detach_pending:
            assert deliveries[0].upper is not None
            bounds = (lower, deliveries[0].upper - MICROSECOND)
            if not _move_day(engine, settings, deliveries[0].name, now, bounds, holds, wait):
                holds.postponed.append(day)
                log.info("partition_drop_postponed", day=day, reason="lease")
                continue
            expired_dead = _dead_letters_in(engine, deliveries[0].name)
        else:
            expired_dead = 0
        _retire_filtered(engine, settings, leaves)
        if not _detach_and_drop(engine, settings, leaves, now):
            holds.postponed.append(day)
            log.info("partition_drop_postponed", day=day, reason="held_after_moves")
            continue
        holds.dead_letters_expired += expired_dead
        dropped += leaves
    log_holds(holds)
    if dropped:
        log.info("partitions_dropped", count=len(dropped))
    return Expiry(now=at, dropped=[p.name for p in dropped], holds=holds)


def drop_expired_partitions(engine: Engine, settings: Settings, now: datetime | None) -> list[str]:
    """:func:`expire_partitions`, returning only the names of the partitions dropped."""
    return expire_partitions(engine, settings, now).dropped
