"""Crash marks (migration 0013): which attempts a dying worker held, ``suspect`` (the stuck
handler it dies for) or ``bystander`` (the rest of its pool), so that the next claim counts a
redelivery against suspects (and unmarked rows) only (:mod:`tasks.crashes`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

import psycopg

# A worker's watchdog names the deliveries it is about to kill for (tasks.pools): each one's
# attempt in flight, marked only while that attempt still holds it (a handler that finished
# meanwhile, or a lease already taken over, is left alone).
_MARK_CRASH_SQL = """
    UPDATE deliveries d SET crash_mark = CASE WHEN w.suspect THEN 'suspect' ELSE 'bystander' END
    FROM unnest(%(ids)s::bigint[], %(expiries)s::timestamptz[], %(attempts)s::integer[],
                %(suspects)s::boolean[]) AS w(id, expires_at, attempt, suspect)
    WHERE d.id = w.id AND d.expires_at = w.expires_at AND d.status = 'processing'
      AND d.attempts = w.attempt
"""


class Held(NamedTuple):
    """A delivery attempt in flight: its row and fencing token."""

    id: int
    expires_at: datetime
    attempt: int


def mark_crash(conn: psycopg.Connection[Any], suspects: list[Held], bystanders: list[Held]) -> int:
    """Mark the attempts a dying worker held: ``suspect`` (a stuck handler it dies for) or
    ``bystander``. The next claim counts a redelivery against suspects (and unmarked rows)
    only. One statement; returns the rows marked."""
    marked = [(h, True) for h in suspects] + [(h, False) for h in bystanders]
    cur = conn.execute(
        _MARK_CRASH_SQL,
        {
            "ids": [h.id for h, _ in marked],
            "expiries": [h.expires_at for h, _ in marked],
            "attempts": [h.attempt for h, _ in marked],
            "suspects": [s for _, s in marked],
        },
    )
    return cur.rowcount
