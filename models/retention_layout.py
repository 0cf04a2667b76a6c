"""Partition mode's layout: the daily partitions laid out ahead through the longest TTL of
the existing sources (:func:`ensure_partitions`), and the empty days beyond what they need
trimmed (:func:`trim_layout`). The rules of expiry: :mod:`models.retention`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta

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
from models.retention_holds import DROP_ORDER, decision_time

log = get_logger("retention")


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
        at = decision_time(conn, now)
        last = _layout_end(at, longest, settings)
        existing = {p.name for p in partitions.list_partitions(conn)}
        day = (at - timedelta(days=1)).date()
        while day <= last:
            _, upper = partitions.day_bounds(day)
            names = [partitions.partition_name(t, day) for t in DROP_ORDER]
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
            at = decision_time(conn, now)
            last = _layout_end(at, longest, settings)
            bound = _layout_end(at, max(longest, _longest_provider_default(settings)), settings)
            days: dict[date, list[partitions.Partition]] = {}
            for p in partitions.list_partitions(conn):
                if p.lower is None or p.table not in DROP_ORDER:
                    continue
                day = p.lower.astimezone(UTC).date()
                if last < day <= bound:
                    days.setdefault(day, []).append(p)
            for day in sorted(days):
                leaves = sorted(days[day], key=lambda p: DROP_ORDER[p.table])
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
    return detach_then_drop(
        conn, leaves, keep=lambda: not all(_empty(conn, p.name) for p in leaves)
    )


def detach_then_drop(
    conn: Connection, leaves: list[partitions.Partition], *, keep: Callable[[], bool]
) -> bool:
    """Detach a day's leaves (those already out attached again if one detach fails), then,
    once nothing can reach them, attach them back untouched when ``keep()`` says so, or drop
    them. Returns whether they were dropped (:func:`trim_layout`, and the expiry's drop)."""
    detached: list[partitions.Partition] = []
    try:
        for leaf in leaves:
            partitions.detach(conn, leaf)
            detached.append(leaf)
    except Exception:
        restore_detached(conn, detached)
        raise
    if keep():
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


def restore_detached(conn: Connection, detached: list[partitions.Partition]) -> None:
    """A detach failed part way (its timeout): attach again the leaves already out, so the
    day stays whole and listed; the one left pending is finished by the next run."""
    for leaf in detached:
        try:
            partitions.reattach(conn, leaf)
        except Exception as exc:  # noqa: BLE001  (the detach's error is the one raised)
            log.warning("partition_reattach_failed", error_class=type(exc).__name__)
