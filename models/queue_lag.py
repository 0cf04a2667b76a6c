"""The queue lag the pipeline actually has, read from the database (issue 35 item 4).

The dedup TTL's ``queue_lag`` term budgets "your own p99 time from received to processed"
(core/ttl.py). This module measures that p99, per source, from the rows every process shares
(never one process's histogram):

- every delivery of the receipts received in the window ``[now - window, now)``: its lag is
  ``receipts.received_at`` to its final outcome (``succeeded_at`` or ``dead_at``), or, still
  unfinished at ``now``, its age so far (a lower bound: a backlog counts while it lasts, not
  only once it drains);
- every delivery still unfinished whose receipt arrived before the window: its age so far.
  Without these a backlog older than the window would be invisible, and with a 24 h window
  nothing received in it can be more than 24 h late: the default 1 d budget could never be
  exceeded.

Not counted: deliveries replayed or re-run (``attempt_base > 0``: their lag is an operator's
decision, the ``replay_grace`` term's), and discarded ones (an operator ended them). A
delivery that finished within the window but arrived before it is counted only while it was
unfinished (the second set, at each run before it finished): finished rows have no index on
their outcome time, and finding them would scan every receipt of the TTL.

Cost: both reads use existing indexes (each receipts leaf's ``received_at`` index, bounded
by the window; the partial ``ix_deliveries_due`` of the unfinished rows), each receipt's
deliveries found by ``(receipt_id, route_id, expires_at)`` in the one partition its
``expires_at`` names; one exact ``percentile_cont`` per source over the rows read
(docs/retention.md gives the measured cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, text

# One row per source with deliveries in the population: its p99 lag in seconds, its count.
_P99 = """
WITH clock AS MATERIALIZED (
    SELECT coalesce(CAST(:now AS timestamptz), now()) AS now
), recent AS (
    SELECT d.source_id,
           extract(epoch FROM least(
               CASE d.status WHEN 'succeeded' THEN d.succeeded_at
                             WHEN 'dead' THEN d.dead_at END,
               (SELECT now FROM clock)) - r.received_at) AS lag
    FROM receipts r
    JOIN deliveries d ON d.receipt_id = r.id AND d.expires_at = r.expires_at
    WHERE r.received_at >= (SELECT now FROM clock) - CAST(:window AS interval)
      AND r.received_at < (SELECT now FROM clock)
      AND d.status NOT IN ('discarded', 'filtered') AND d.attempt_base = 0 {source}
), backlog AS (
    SELECT d.source_id,
           extract(epoch FROM (SELECT now FROM clock) - r.received_at) AS lag
    FROM deliveries d
    JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at
    WHERE d.status IN ('pending', 'retrying', 'processing') AND d.attempt_base = 0
      AND r.received_at < (SELECT now FROM clock) - CAST(:window AS interval) {source}
)
SELECT source_id, percentile_cont(0.99) WITHIN GROUP (ORDER BY lag), count(*)
FROM (SELECT * FROM recent UNION ALL SELECT * FROM backlog) AS lags
GROUP BY source_id
"""
ALL_SOURCES = text(_P99.format(source=""))
ONE_SOURCE = text(_P99.format(source="AND d.source_id = :source_id"))

_SOURCES = text("SELECT id, public_id, queue_lag_s FROM sources ORDER BY id")


@dataclass(frozen=True)
class MeasuredLag:
    """A source's measured p99 queue lag over ``window`` up to ``at`` (None: no delivery)."""

    p99: timedelta | None
    deliveries: int
    window: timedelta
    at: datetime


@dataclass(frozen=True)
class SourceLag:
    source_id: int
    public_id: str
    queue_lag_override: timedelta | None  # the source's own term; None: the setting's
    measured: MeasuredLag


def _at(conn: Connection, now: datetime | None) -> datetime:
    if now is not None:
        return now
    at: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return at


def measure(
    conn: Connection, now: datetime | None, window: timedelta, source_id: int | None = None
) -> dict[int, MeasuredLag]:
    """The p99 queue lag of each source with deliveries in the population (see the module);
    ``source_id``: that source's alone. ``now`` None: the database's clock."""
    at = _at(conn, now)  # one instant for the statement and the answer
    params: dict[str, object] = {"now": at, "window": window}
    statement = ALL_SOURCES
    if source_id is not None:
        statement, params["source_id"] = ONE_SOURCE, source_id
    return {
        int(sid): MeasuredLag(timedelta(seconds=max(0.0, float(p99))), int(n), window, at)
        for sid, p99, n in conn.execute(statement, params).all()
    }


def measure_sources(conn: Connection, now: datetime | None, window: timedelta) -> list[SourceLag]:
    """Every source (a label each: sources are few), with its measured lag (``p99`` None and
    no deliveries when nothing was in the population) and its queue-lag override."""
    at = _at(conn, now)
    measured = measure(conn, at, window)
    out = []
    for sid, public_id, override_s in conn.execute(_SOURCES).all():
        lag = measured.get(sid, MeasuredLag(None, 0, window, at))
        override = None if override_s is None else timedelta(seconds=override_s)
        out.append(SourceLag(int(sid), str(public_id), override, lag))
    return out
