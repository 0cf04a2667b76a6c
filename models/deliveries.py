"""The worker's statements on a message's deliveries (tasks/pipeline.py runs them in order):
the probe before the claim, the claim, the success, the check after a success that matched
no row, and the fallback to the parent tables when a leaf partition is missing.

Each takes the driver's connection in autocommit (one round trip, its own transaction). For
a message of one id the probe, the claim and the success use their one-row forms (``d.id =
%(id)s``, :func:`models.transitions.claim_with_event`, :func:`~models.transitions.succeed`):
the single-id plan, measured the fastest for a message of one id (bench/results_workers.txt,
issue 19: 3 statements per message, tests/test_worker_connections.py counts them). The
choice is made here, once per statement; the worker's steps take one path for n >= 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

import psycopg

from models import transitions
from models.partitions import leaf_suffix
from models.transitions import Claim, ClaimedEvent, IllegalTransition, Wanted

T = TypeVar("T")

# Each delivery's key generation (it names the fast claim), its partition key (the claim then
# touches one partition), whether Postgres shows the row claimable now and past its publish
# grace or lease, or pending after two of the sweeper's re-publishes, which move its
# next_attempt_at ahead each time (a fast-claim key held for such a row is stale:
# tasks/steps/claim.py), and whether its previous holder died with the lease (isolated, in a
# message of several). On the database's clock, like the claim.
_PROBE = """
    SELECT d.id, d.generation, d.expires_at,
           d.status IN ('pending', 'retrying', 'processing')
           AND (CASE d.status WHEN 'processing' THEN d.lease_until
                              ELSE d.next_attempt_at END <= t.now
                OR d.status = 'pending' AND d.republished >= 2),
           d.status = 'processing' AND d.lease_until <= t.now
    FROM deliveries d, (SELECT coalesce(%(now)s::timestamptz, now()) AS now) t
    WHERE {where}
"""
_PROBE_ONE = _PROBE.format(where="d.id = %(id)s")
_PROBE_MANY = _PROBE.format(where="d.id = ANY(%(ids)s::bigint[])")

# Which of these attempts' successes are committed: asked only when a success statement
# matched no row, which is either a lease lost to another attempt or a commit whose answer
# was lost to a connection error and that was tried again.
_RECORDED = """
    SELECT id FROM deliveries
    WHERE id = ANY(%(ids)s::bigint[]) AND status = 'succeeded'
      AND (id, attempts, generation) IN (
          SELECT * FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(generations)s::int[]))
"""


class Probed(NamedTuple):
    """What the probe read of one delivery."""

    generation: int
    expires_at: datetime
    overdue: bool  # claimable now and past its grace or lease: a held fast claim is stale
    lease_expired: bool  # processing, its holder's lease ran out (a dead worker)


def probe(
    raw: psycopg.Connection[Any], ids: Sequence[int], *, now: datetime | None
) -> dict[int, Probed]:
    """The deliveries of ``ids`` that exist, by id (one statement, changes nothing)."""
    if len(ids) == 1:  # the one-row plan (the module's docstring)
        rows = raw.execute(_PROBE_ONE, {"id": ids[0], "now": now}).fetchall()
    else:
        rows = raw.execute(_PROBE_MANY, {"ids": list(ids), "now": now}).fetchall()
    return {int(r[0]): Probed(int(r[1]), r[2], bool(r[3]), bool(r[4])) for r in rows}


def claim(
    raw: psycopg.Connection[Any],
    wanted: list[Wanted],
    *,
    now: datetime | None,
    lease: timedelta,
    max_redeliveries: int,
    worker: str,
    leaf: str | None,
) -> list[tuple[Claim, ClaimedEvent]]:
    """The guarded claim of these deliveries of one partition, each with its route, source
    and receipt (:func:`models.transitions.claim_many_with_event`)."""
    if len(wanted) == 1:  # the one-row plan (the module's docstring)
        one = wanted[0]
        claimed = transitions.claim_with_event(
            raw,
            one.id,
            generation=one.generation,
            expires_at=one.expires_at,
            now=now,
            lease=lease,
            max_redeliveries=max_redeliveries,
            worker=worker,
            leaf=leaf,
        )
        return [] if claimed is None else [claimed]
    return transitions.claim_many_with_event(
        raw,
        wanted,
        now=now,
        lease=lease,
        max_redeliveries=max_redeliveries,
        worker=worker,
        leaf=leaf,
    )


def succeed(
    raw: psycopg.Connection[Any],
    pairs: list[tuple[Claim, datetime]],
    *,
    leaf: str | None,
    refs: Sequence[str | None] | None = None,
) -> set[int]:
    """The guarded success of these attempts of one partition (one synchronous commit), each
    with its handler's result reference (``refs``, in order; none by default). The ids that
    moved; one missing lost its lease, or this is a retry of a commit whose answer was lost
    (:func:`recorded` tells)."""
    if len(pairs) == 1:  # the one-row plan (the module's docstring)
        found, at = pairs[0]
        try:
            transitions.succeed(raw, found, now=at, leaf=leaf, result_ref=refs[0] if refs else None)
        except IllegalTransition:
            return set()
        return {found.id}
    return transitions.succeed_many(raw, pairs, leaf=leaf, refs=refs)


def recorded(raw: psycopg.Connection[Any], found: Sequence[Claim]) -> set[int]:
    """Which of these attempts' successes are committed."""
    params = {
        "ids": [f.id for f in found],
        "attempts": [f.attempt for f in found],
        "generations": [f.generation for f in found],
    }
    return {int(r[0]) for r in raw.execute(_RECORDED, params).fetchall()}


# Leaf partitions found missing in this process (an unusual layout): use the parents.
_MISSING_LEAVES: set[str] = set()


def leaf_for(expires_at: datetime, mode: str) -> str | None:
    """The leaf partition a statement on this delivery names, or None for the parents (a
    generic plan on the partitioned parents locks every partition)."""
    leaf = leaf_suffix(expires_at, mode)
    return None if leaf in _MISSING_LEAVES else leaf


def on_leaf(leaf: str | None, statement: Callable[[str | None], T]) -> T:
    """Run an autocommit statement on the delivery's leaf partitions, or on the parents when
    that leaf does not exist (nothing ran: the failed statement was its own transaction)."""
    if leaf is None:
        return statement(None)
    try:
        return statement(leaf)
    except psycopg.errors.UndefinedTable:
        _MISSING_LEAVES.add(leaf)
        return statement(None)
