"""Ordered lanes per entity (issue 37 items 2 and 3; migrations 0028 and 0033).

A route with an order key gives each delivery a lane key (its value on the event, computed by
the receiver before the accept: :func:`core.filters.lane_key`). Deliveries of one route and
key form a lane, in delivery id order (the order the accept wrote them). A delivery with a
lane key is claimable only when

- no other delivery of its lane with a lower id is unfinished: pending, retrying, processing,
  or dead while its route's ``lane_on_dead`` is ``block`` (``skip``: a dead letter no longer
  holds its lane; a replay makes it pending again, and it is older than its successors, so
  it takes its place back at the head); and
- no other delivery of its lane is processing under a live lease (a replayed or re-run older
  delivery waits for a younger one already running, never overlaps it).

So only a lane's head can be claimed. Where the lane is read: ``lane_members`` (migration
0033), one row per laned delivery in those four statuses, kept in step with ``deliveries`` by
row triggers in every writing statement's own transaction; small and unpartitioned, so
``webhooks_lane_clear`` (:func:`guard`) is two index probes, where 0028's read of the
partitioned ``deliveries`` locked every partition on each call (bench/results_lanes.txt).

The claim itself is checked by the BEFORE UPDATE trigger ``webhooks_lane_claim``: when a laned
delivery becomes processing with one more attempt, it reads the lane's members in a fresh
snapshot, and, the lane clear, takes the lane's advisory lock (a try-lock held to the claim's
commit) and reads them once more; if the lane is not clear, or another claim of the lane
holds the lock, the row is left as it was and the claim returns nothing for it. So two
hosts, or two connections racing, cannot run two deliveries of one key at once, even when an
operator's replay made an older one claimable between their snapshots. Postgres is the
record: a kill -9 leaves the head processing until its lease expires (the sweeper then
publishes it again, and only it), a Redis flush loses no lane state at all.

A lane-refused claim burns no attempt (the UPDATE matched nothing): the worker reports the
delivery ``lane`` (:mod:`tasks.steps.claim`), frees its admission slot, and publishes the
lane's head if it opened meanwhile. Whoever ends a lane's delivery publishes the lane's next
head right after its commit (:func:`next_heads`), in the admission slot the ended one leaves
(:meth:`models.admission.Admission.hand_over`), so an ordered route drains without waiting
for the sweeper, whose pick takes lane heads only (the same guard), so a blocked lane costs no
message per sweep.

Supersede (item 3): under the lane, a claimed delivery of a ``supersede`` route whose event's
signed time (``receipts.occurred_at``) is older than that of an event of its key already
succeeded on the route is moved ``processing -> superseded`` (:func:`newer_success`,
:func:`models.transitions.supersede`) and its handler is not called.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from models.statements import placeholders

#: The statuses a lane waits on (the statuses of ``lane_members``' rows).
OPEN = "('pending', 'processing', 'retrying', 'dead')"


def guard(row: str) -> str:
    """The lane condition for the delivery row aliased ``row`` (true for an unordered one):
    ``webhooks_lane_clear`` (migration 0033) reads the lane's members in the caller's
    snapshot. The sweeper's pick reads it; a claim is checked by the trigger."""
    return (
        f"({row}.lane_key IS NULL"
        f" OR webhooks_lane_clear({row}.route_id, {row}.lane_key, {row}.id, :now))"
    )


class Head(NamedTuple):
    """A lane's head, due to be published, and its lane (route id, lane key)."""

    delivery_id: int
    event_id: str | None
    source: str | None
    lane: tuple[int, str] | None = None


# Per lane, its first member (dead ones left out on a ``skip`` route), taken from
# ix_lane_members_lane by a LIMIT 1; published when it is pending, or retrying and due, and
# the lane lets it run. Reads the members only (migration 0033), never ``deliveries``.
_NEXT_HEADS = placeholders("""
    SELECT h.delivery_id, w.route_id, w.key
    FROM unnest(CAST(:routes AS bigint[]), CAST(:keys AS text[])) AS w(route_id, key)
    JOIN routes rt ON rt.id = w.route_id
    CROSS JOIN LATERAL (
        SELECT m.delivery_id, m.status, m.next_attempt_at FROM lane_members m
        WHERE m.route_id = w.route_id AND m.lane_key = w.key
          AND (m.status <> 'dead' OR rt.lane_on_dead = 'block')
        ORDER BY m.delivery_id LIMIT 1
    ) h
    WHERE (h.status = 'pending' OR (h.status = 'retrying' AND h.next_attempt_at <= :now))
      AND webhooks_lane_clear(w.route_id, w.key, h.delivery_id, :now)
    ORDER BY h.delivery_id
""")


def next_heads(
    conn: psycopg.Connection[Any], lanes: Sequence[tuple[int, str]], *, now: datetime | None
) -> list[Head]:
    """The claimable head of each of these lanes (route id, lane key) that is pending, or
    retrying and due: what to publish once a delivery of the lane ended. One statement."""
    wanted = sorted(set(lanes))
    if not wanted:
        return []
    rows = conn.execute(
        _NEXT_HEADS,
        {"routes": [r for r, _ in wanted], "keys": [k for _, k in wanted], "now": now},
    ).fetchall()
    return [Head(int(r[0]), None, None, (int(r[1]), str(r[2]))) for r in rows]


_WAITING = placeholders("""
    SELECT m.delivery_id, m.route_id, m.lane_key FROM lane_members m
    WHERE m.delivery_id = ANY(CAST(:ids AS bigint[]))
      AND m.status IN ('pending', 'retrying', 'processing')
      AND NOT webhooks_lane_clear(m.route_id, m.lane_key, m.delivery_id, :now)
""")


def waiting(
    conn: psycopg.Connection[Any], ids: Sequence[int], *, now: datetime | None
) -> dict[int, tuple[int, str]]:
    """Of these deliveries, those their lane holds back (an earlier one of their key is
    unfinished): each one's route id and lane key."""
    rows = conn.execute(_WAITING, {"ids": list(ids), "now": now}).fetchall()
    return {int(r[0]): (int(r[1]), str(r[2])) for r in rows}


_NEWER_SUCCESS = placeholders("""
    SELECT r.event_id FROM deliveries d
    JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at
    WHERE d.route_id = :route_id AND d.lane_key = :lane_key AND d.lane_key IS NOT NULL
      AND d.status = 'succeeded' AND d.id <> :id AND r.occurred_at > :occurred_at
    ORDER BY r.occurred_at DESC, d.id DESC
    LIMIT 1
""")


def newer_success(
    conn: psycopg.Connection[Any],
    *,
    delivery_id: int,
    route_id: int,
    lane_key: str,
    occurred_at: datetime,
) -> str | None:
    """The event id of the newest event of this lane already succeeded on the route whose
    signed time is after ``occurred_at``, or None: the supersede check, made under the lane
    (no other delivery of the key runs meanwhile)."""
    row = conn.execute(
        _NEWER_SUCCESS,
        {
            "route_id": route_id,
            "lane_key": lane_key,
            "id": delivery_id,
            "occurred_at": occurred_at,
        },
    ).fetchone()
    return None if row is None else str(row[0])


_BLOCKED = placeholders("""
    SELECT h.route_id, count(*) FROM (
        SELECT DISTINCT ON (m.route_id, m.lane_key) m.route_id, m.status
        FROM lane_members m JOIN routes rt ON rt.id = m.route_id
        WHERE m.status <> 'dead' OR rt.lane_on_dead = 'block'
        ORDER BY m.route_id, m.lane_key, m.delivery_id
    ) h
    WHERE h.status = 'dead'
    GROUP BY h.route_id
""")


def blocked(conn: psycopg.Connection[Any]) -> dict[int, int]:
    """Per route, its lanes a dead letter blocks (``lane_on_dead`` block): what
    ``webhooks_lanes_blocked`` shows. Reads the lane members (migration 0033)."""
    return {int(r[0]): int(r[1]) for r in conn.execute(_BLOCKED).fetchall()}
