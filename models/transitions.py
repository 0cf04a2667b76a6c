"""Every delivery state change, each one guarded SQL statement naming the states it leaves.

    pending -> processing -> succeeded
                  |   ^
                  v   |
                retrying --(exhausted / permanent)--> dead
    dead -> pending        (replay: same downstream key generation)
    succeeded -> pending   (re-run: generation + 1)

A statement that matches no row means the transition was illegal from the row's current state;
callers that require it raise :class:`IllegalTransition` (finishing), callers for which "no
row" is a normal answer (claiming, replaying) get ``None``. The attempt number doubles as a
fencing token: a worker whose lease expired and was re-claimed can no longer finish. It only
grows: a replay or re-run continues it (``attempt_base`` remembers where, for the retry
policy), so a worker frozen before a replay can never match a later attempt's guard.

Time: every comparison here (lease expired, retry due) is made on the database's clock,
``now()`` inside the statement, never a host's. ``now`` parameters are None in production;
a test pins an instant by passing one (:func:`core.clock.pinned`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import psycopg
from sqlalchemy.orm import Session

from core.errors import WebhooksError
from core.states import AttemptOutcome, DeliveryStatus
from models import ledger
from models.statements import Target, fetchone, placeholders


class TransitionError(WebhooksError):
    """Base class of state machine errors."""


class IllegalTransition(TransitionError):
    """The row was not in a state the transition may leave from."""

    def __init__(self, delivery_id: int, transition: str, allowed: str) -> None:
        super().__init__(f"delivery {delivery_id}: {transition} requires status {allowed}")
        self.delivery_id = delivery_id
        self.transition = transition
        self.reason = "illegal_transition"


@dataclass(frozen=True)
class Claim:
    """A delivery this worker now owns until ``lease_until`` (or a dead verdict on a crash loop)."""

    id: int
    expires_at: datetime
    receipt_id: int
    source_id: int
    route_id: int
    attempt: int
    redeliveries: int
    generation: int
    created_at: datetime
    first_attempt_at: datetime
    lease_until: datetime | None  # None: the crash-loop verdict (dead) holds no lease
    status: str  # "processing", or "dead" when this claim found one crash too many
    attempt_base: int  # ``attempt`` when last replayed or re-run (the policy counts from it)
    at: datetime  # the instant the claim was decided at (the database's clock)
    # Its lane (models/lanes.py, migration 0028): the value of its route's order key on its
    # event; None: unordered.
    lane_key: str | None = None

    @property
    def attempts_in_run(self) -> int:
        """This attempt's number since the last replay or re-run (1-based): what the retry
        policy's ``max_attempts`` and backoff count."""
        return self.attempt - self.attempt_base

    @property
    def crashed_too_often(self) -> bool:
        return self.status == DeliveryStatus.DEAD


# The claim's assignments, shared by the one-delivery and the several-deliveries statements:
# pending | retrying | processing (lease expired) -> processing, attempts + 1, or dead on one
# crash too many (``status``, ``redeliveries`` and ``crash_mark`` are the row's values before
# the update).
_CLAIM_SET = """\
            redeliveries = redeliveries + CASE WHEN {crashed} THEN 1 ELSE 0 END,
            status = CASE WHEN {crash_loop} THEN 'dead' ELSE 'processing' END,
            dead_reason = CASE WHEN {crash_loop} THEN 'crashed' ELSE dead_reason END,
            dead_at = CASE WHEN {crash_loop} THEN :now ELSE dead_at END,
            attempts = attempts + CASE WHEN {crash_loop} THEN 0 ELSE 1 END,
            lease_until = CASE WHEN {crash_loop} THEN NULL ELSE :now + :lease END,
            next_attempt_at = CASE WHEN {crash_loop} THEN NULL ELSE :now + :lease END,
            first_attempt_at = coalesce(first_attempt_at, :now),
            republished = 0,
            crash_mark = NULL,
            updated_at = :now""".format(
    # The previous holder died with the lease: a crash counted against this delivery unless
    # its worker's watchdog named it a bystander of another's stuck handler (tasks.pools):
    # a suspect, or a death that named nobody (a kill -9 from outside), counts.
    crashed="status = 'processing' AND crash_mark IS DISTINCT FROM 'bystander'",
    crash_loop="status = 'processing' AND crash_mark IS DISTINCT FROM 'bystander'"
    " AND redeliveries + 1 >= :max_redeliveries",
)

# The route's gate (models/breaker.py): a delivery is held, not claimed, while its route is
# paused or its breaker is open, or half-open and this is not the probe. One primary-key
# lookup of the route inside the claim; a route that is gone holds nothing (the worker
# turns its delivery into a dead letter, route_gone).
_GATE = """\
          AND NOT EXISTS (
              SELECT 1 FROM routes g WHERE g.id = deliveries.route_id
                AND (g.paused_at IS NOT NULL
                     OR (g.breaker_state <> 'closed'
                         AND g.probe_delivery IS DISTINCT FROM deliveries.id)))"""

# What the worker's claims return: the claim, its route and source, the receipt's event (the
# caller adds the receipt join). Kept short: psycopg caches the conversion of a statement of
# at most 4,096 characters only (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH; checked by
# tests/test_transitions.py), so the columns only ``claimed`` has go without their alias.
_CLAIMED_EVENT = """\
    SELECT c.id, c.expires_at, c.receipt_id, c.source_id, c.route_id, c.attempts,
           redeliveries, c.generation, c.created_at, first_attempt_at, lease_until,
           c.status, attempt_base, c.at, lane_key,
           rt.id IS NOT NULL, rt.handler, rt.options, rt.signing_ciphertext, rt.max_attempts,
           rt.max_age_s, rt.active, rt.breaker_state, rt.window_failures, rt.released_at,
           rt.rate_count, rt.rate_period_s, rt.breaker_opened_at,
           s.public_id, s.name, s.provider, s.retry_window_s, s.queue_lag_s, s.clock_skew_s,
           s.replay_grace_s,
           r.id IS NOT NULL, r.event_id, r.event_type, r.occurred_at, r.received_at,
           r.content_type, r.payload, rt.transform, rt.supersede
    FROM claimed c
    LEFT JOIN routes rt ON rt.id = c.route_id
    LEFT JOIN sources s ON s.id = rt.source_id
"""


# One statement: the guarded claim, the previous attempt marked crashed when its worker died
# holding the lease, and this attempt's row. (All parts see one snapshot; a successful claim
# leaves no live attempt behind it, so any attempt still open then belongs to a dead worker.)
_CLAIM_SQL = """
    WITH claimed AS (
        UPDATE {deliveries} SET
{claim_set}
        WHERE id = :id {expires_match} {generation_match}
          AND (status = 'pending'
               OR (status = 'retrying' AND next_attempt_at <= :now)
               OR (status = 'processing' AND lease_until <= :now))
{gate}
        RETURNING id, expires_at, receipt_id, source_id, route_id, attempts, redeliveries,
                  generation, created_at, first_attempt_at, lease_until, status, attempt_base,
                  :now AS at, lane_key
    ), crashed AS (
        UPDATE {attempts} SET outcome = 'crashed', ended_at = :now,
            error_class = 'WorkerLost', error_message = 'lease expired while processing'
        WHERE delivery_id = :id AND expires_at = {attempt_expiry}
          AND ended_at IS NULL
          AND EXISTS (SELECT 1 FROM claimed)  -- only a claim that won: never a live attempt
    ), started AS (
        INSERT INTO {attempts} (expires_at, delivery_id, number, generation, worker, started_at)
        SELECT expires_at, id, attempts, generation, :worker, :now
        FROM claimed WHERE status = 'processing'
    )
    {select}
    """

_SELECT_CLAIM = "SELECT * FROM claimed"

# The worker's variant: the claim and what running the handler needs, in one statement and
# (in autocommit) one transaction. Its commit is synchronous, like every commit of ours: the
# handler makes its effect right after it (a downstream called), and a claim that a Postgres
# crash could still undo would let another worker claim the same attempt and call the
# downstream a second time (issue 32: 7 and 12 repeats at a crash came from the asynchronous
# claim this once was). Route and source may be gone (left joins): the caller turns that into
# a permanent failure. The receipt shares the delivery's expires_at; naming it by the
# parameter (not the claimed row's column) lets the generic plan prune the receipts
# partitions when it starts, instead of opening every partition's scan each time.
_SELECT_CLAIM_AND_EVENT = """
{claimed_event}    LEFT JOIN {receipts} r ON r.id = c.receipt_id AND r.expires_at = :expires_at
    """


def _tables(leaf: str | None) -> dict[str, str]:
    """Table names for a statement: the partitioned parents, or one day's leaf partitions
    (``<table>_<leaf>``, aliased to the parent's name so the statement reads the same).

    Why leaves: a generic plan on a parent locks every partition (and more than 16 locks
    leave Postgres's fast path); the worker's claim with its event read cost about 1 ms that
    way against 0.26 ms on the leaves (bench/results_workers.txt)."""
    if leaf is None:
        return {"deliveries": "deliveries", "attempts": "attempts", "receipts": "receipts"}
    return {
        "deliveries": f"deliveries_{leaf} AS deliveries",
        "attempts": f"attempts_{leaf} AS attempts",
        "receipts": f"receipts_{leaf}",
    }


def _leaf(leaf: str | None) -> str | None:
    if leaf is not None and re.fullmatch(r"p\d{8}|default", leaf) is None:
        raise ValueError(f"not a partition suffix: {leaf!r}")
    return leaf


@functools.cache
def _claim_sql(*, worker: bool, leaf: str | None = None) -> str:
    """The claim by id alone (:func:`claim`: every partition's index), or the worker's
    (:func:`claim_with_event`: its partition, its generation, the event with it)."""
    tables = _tables(_leaf(leaf))
    return placeholders(
        _CLAIM_SQL.format(
            expires_match="AND expires_at = :expires_at" if worker else "",
            attempt_expiry=":expires_at" if worker else "(SELECT expires_at FROM claimed)",
            generation_match="AND generation = :generation" if worker else "",
            select=(_SELECT_CLAIM_AND_EVENT if worker else _SELECT_CLAIM).format(
                claimed_event=_CLAIMED_EVENT, **tables
            ),
            claim_set=_CLAIM_SET,
            gate=_GATE,
            **tables,
        )
    )


class ClaimedEvent(NamedTuple):
    """What the worker's claim returns besides the claim: route, source and receipt fields
    (``route_found`` / ``receipt_found`` False when that row is gone)."""

    route_found: bool
    handler: str | None
    options: dict[str, Any] | None
    signing_ciphertext: bytes | None
    max_attempts: int | None
    max_age_s: int | None
    active: bool | None
    breaker_state: str | None  # closed | open | half_open (models/breaker.py)
    window_failures: int | None  # failures in the route's open window: successes count too
    released_at: datetime | None  # the route's last resume by hand (max_age counts after)
    rate_count: int | None  # the route's rate limit: calls per rate_period_s (None: none)
    rate_period_s: int | None
    breaker_opened_at: datetime | None  # when its breaker last opened (an expired probe says)
    public_id: str | None
    name: str | None
    provider: str | None
    retry_window_s: int | None
    queue_lag_s: int | None
    clock_skew_s: int | None
    replay_grace_s: int | None
    receipt_found: bool
    event_id: str | None
    event_type: str | None
    occurred_at: datetime | None
    received_at: datetime | None
    content_type: str | None
    payload: bytes | None
    transform: str | None = None  # the route's transform (tasks.transforms; None: none)
    # The route supersedes stale events of a lane (models/lanes.py); None: the route is gone.
    supersede: bool | None = False


def claim(
    session: Session,
    delivery_id: int,
    *,
    now: datetime | None,
    lease: timedelta,
    max_redeliveries: int,
    worker: str,
) -> Claim | None:
    """pending | retrying (due) | processing (lease expired) -> processing, attempts + 1.

    Returns None when the delivery is done, dead, not yet due, or owned by a live lease.
    A claim that finds an expired lease counts a redelivery (the previous holder died) and
    records that attempt as crashed; at ``max_redeliveries`` it goes dead instead. One
    statement, by id alone, in the session's transaction (tools and tests; the worker runs
    :func:`claim_with_event`, the same transition).
    """
    row = fetchone(
        session,
        _claim_sql(worker=False),
        {
            "id": delivery_id,
            "now": now,
            "lease": lease,
            "max_redeliveries": max_redeliveries,
            "worker": worker,
        },
    )
    return None if row is None else Claim(*row)


def claim_with_event(
    conn: psycopg.Connection[Any],
    delivery_id: int,
    *,
    generation: int,
    expires_at: datetime,
    now: datetime | None,
    lease: timedelta,
    max_redeliveries: int,
    worker: str,
    leaf: str | None = None,
) -> tuple[Claim, ClaimedEvent] | None:
    """The worker's claim (the same guarded transition as :func:`claim`, also requiring the
    key generation the worker read), returning the route, source and receipt with it: one
    statement, one partition. Run it in autocommit: one round trip, one synchronous commit.
    ``leaf``: run it on that day's leaf partitions (:func:`models.partitions.leaf_suffix`);
    psycopg.errors.UndefinedTable if they do not exist (run it again without)."""
    row = fetchone(
        conn,
        _claim_sql(worker=True, leaf=leaf),
        {
            "expires_at": expires_at,
            "generation": generation,
            "id": delivery_id,
            "now": now,
            "lease": lease,
            "max_redeliveries": max_redeliveries,
            "worker": worker,
        },
    )
    if row is None:
        return None
    return Claim(*row[:15]), ClaimedEvent(*row[15:44])


# The worker's claim of several deliveries at once (a message carrying several ids): the same
# guarded transition, per row, for the (id, generation, expires_at) triples the worker read.
# Rows are joined in id order, so two such statements over the same ids lock them in one order.
_CLAIM_MANY_SQL = """
    WITH want AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:generations AS integer[]),
                             CAST(:expiries AS timestamptz[])) AS w(id, generation, expires_at)
        ORDER BY id
    ), claimed AS (
        UPDATE {deliveries} SET
{claim_set}
        FROM want
        WHERE deliveries.id = want.id AND deliveries.expires_at = want.expires_at
          AND deliveries.generation = want.generation
          AND (status = 'pending'
               OR (status = 'retrying' AND next_attempt_at <= :now)
               OR (status = 'processing' AND lease_until <= :now))
{gate}
        RETURNING deliveries.id, deliveries.expires_at, receipt_id, source_id, route_id,
                  attempts, redeliveries, deliveries.generation, created_at, first_attempt_at,
                  lease_until, status, attempt_base, :now AS at, deliveries.lane_key
    ), crashed AS (
        UPDATE {attempts} SET outcome = 'crashed', ended_at = :now,
            error_class = 'WorkerLost', error_message = 'lease expired while processing'
        FROM claimed
        WHERE attempts.delivery_id = claimed.id AND attempts.expires_at = claimed.expires_at
          AND attempts.ended_at IS NULL
    ), started AS (
        INSERT INTO {attempts} (expires_at, delivery_id, number, generation, worker, started_at)
        SELECT expires_at, id, attempts, generation, :worker, :now
        FROM claimed WHERE status = 'processing'
    )
{claimed_event}    LEFT JOIN {receipts} r ON r.id = c.receipt_id AND r.expires_at = c.expires_at
    ORDER BY c.id
    """


class Wanted(NamedTuple):
    """A delivery a worker asks to claim: its id and what it read of it."""

    id: int
    generation: int
    expires_at: datetime


def claim_many_with_event(
    conn: psycopg.Connection[Any],
    wanted: list[Wanted],
    *,
    now: datetime | None,
    lease: timedelta,
    max_redeliveries: int,
    worker: str,
    leaf: str | None = None,
) -> list[tuple[Claim, ClaimedEvent]]:
    """:func:`claim_with_event` for several deliveries in one statement (one round trip, one
    synchronous commit, as there): each row is claimed or not on its own guard; the claimed
    ones come back, in id order, each with its route, source and receipt."""
    sql = _claim_many_sql(leaf)
    rows = conn.execute(
        sql,
        {
            "ids": [w.id for w in wanted],
            "generations": [w.generation for w in wanted],
            "expiries": [w.expires_at for w in wanted],
            "now": now,
            "lease": lease,
            "max_redeliveries": max_redeliveries,
            "worker": worker,
        },
    ).fetchall()
    return [(Claim(*row[:15]), ClaimedEvent(*row[15:44])) for row in rows]


@functools.cache
def _claim_many_sql(leaf: str | None) -> str:
    return placeholders(
        _CLAIM_MANY_SQL.format(
            claim_set=_CLAIM_SET,
            claimed_event=_CLAIMED_EVENT,
            gate=_GATE,
            **_tables(_leaf(leaf)),
        )
    )


# Several successes in one statement (a message's handlers that wrote nothing through their
# sessions), each guarded like :func:`succeed` and each at its own instant.
_SUCCEED_MANY_SQL = """
    WITH want AS (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:expiries AS timestamptz[]),
                             CAST(:attempts AS integer[]), CAST(:generations AS integer[]),
                             CAST(:ats AS timestamptz[]), CAST(:refs AS text[]))
                 AS w(id, expires_at, attempt, generation, at, ref)
        ORDER BY id
    ), done AS (
        UPDATE {deliveries} SET status = 'succeeded', succeeded_at = want.at,
            result_ref = want.ref,
            next_attempt_at = NULL, last_error = NULL, last_error_class = NULL,
            lease_until = NULL, updated_at = want.at
        FROM want
        WHERE deliveries.id = want.id AND deliveries.expires_at = want.expires_at
          AND deliveries.status = 'processing' AND deliveries.attempts = want.attempt
          AND deliveries.generation = want.generation
        RETURNING deliveries.id, deliveries.expires_at, want.attempt, want.generation, want.at,
                  deliveries.receipt_id, {outcome} AS outcome
    ), ended AS (
        UPDATE {attempts} SET ended_at = done.at, outcome = 'succeeded',
            error_class = NULL, error_message = NULL, committed_at = clock_timestamp()
        FROM done
        WHERE attempts.delivery_id = done.id AND attempts.expires_at = done.expires_at
          AND attempts.number = done.attempt AND attempts.generation = done.generation
          AND attempts.ended_at IS NULL
    ), {ledger_row}
    SELECT id FROM done
    """


@functools.cache
def _succeed_many_sql(leaf: str | None) -> str:
    tables = _tables(_leaf(leaf))
    return placeholders(
        _SUCCEED_MANY_SQL.format(
            outcome=ledger.succeeded("deliveries"),
            ledger_row=ledger.append("done", tables["receipts"]),
            **tables,
        )
    )


def succeed_many(
    conn: psycopg.Connection[Any],
    done: list[tuple[Claim, datetime]],
    *,
    leaf: str | None = None,
    refs: Sequence[str | None] | None = None,
) -> set[int]:
    """processing (each one's attempt) -> succeeded, for several deliveries in one statement
    (run it in autocommit: one round trip, one synchronous commit), each with its result
    reference (``refs`` in order; none by default) and its ledger row (one per receipt).
    Returns the ids that moved; a delivery missing from it lost its lease (the caller's
    :class:`IllegalTransition` of :func:`succeed`)."""
    rows = conn.execute(
        _succeed_many_sql(leaf),
        {
            "ids": [found.id for found, _ in done],
            "expiries": [found.expires_at for found, _ in done],
            "attempts": [found.attempt for found, _ in done],
            "generations": [found.generation for found, _ in done],
            "ats": [at for _, at in done],
            "refs": list(refs) if refs is not None else [None] * len(done),
        },
    ).fetchall()
    return {int(row[0]) for row in rows}


@functools.cache
def _finish_sql(assignments: str, leaf: str | None = None, final: str | None = None) -> str:
    """The finishing statement for one transition's assignments (built once per transition
    and partition). ``final``: the transition ends the delivery, and this expression (of
    :mod:`models.ledger`) is its route's outcome in the ledger, written in this statement."""
    tables = _tables(_leaf(leaf))
    returning = "id"
    if final is not None:
        returning += f", receipt_id, expires_at, {final} AS outcome"
    ledger_row = "" if final is None else ", " + ledger.append("done", tables["receipts"])
    return placeholders(
        f"""
        WITH done AS (
            UPDATE {tables["deliveries"]} SET {assignments}, lease_until = NULL, updated_at = :now
            WHERE id = :id AND expires_at = :expires_at AND status = 'processing'
              AND attempts = :attempt AND generation = :generation
            RETURNING {returning}
        ), ended AS (
            UPDATE {tables["attempts"]} SET ended_at = :now, outcome = :outcome,
                error_class = :error_class, error_message = :error,
                committed_at = clock_timestamp()
            WHERE delivery_id = :id AND expires_at = :expires_at AND number = :attempt
              AND generation = :generation AND ended_at IS NULL
              AND EXISTS (SELECT 1 FROM done)
        ){ledger_row}
        SELECT id FROM done
        """  # noqa: S608 (assignments are literals of this module)
    )


def _guarded_finish(
    session: Target,
    found: Claim,
    transition: str,
    assignments: str,
    *,
    now: datetime,
    outcome: str,
    error_class: str | None = None,
    error: str | None = None,
    params: dict[str, Any] | None = None,
    leaf: str | None = None,
    final: str | None = None,
) -> None:
    """One statement: the guarded state change and the end of this attempt's row (and, for
    an ending, its route's outcome in the ledger: ``final``)."""
    sql = _finish_sql(assignments, leaf, final)
    row = fetchone(
        session,
        sql,
        {
            "id": found.id,
            "expires_at": found.expires_at,
            "attempt": found.attempt,
            "generation": found.generation,
            "now": now,
            "outcome": outcome,
            "error_class": error_class,
            "error": error,
            **(params or {}),
        },
    )
    if row is None:
        raise IllegalTransition(found.id, transition, "processing with this attempt")


def succeed(
    session: Target,
    found: Claim,
    *,
    now: datetime,
    leaf: str | None = None,
    result_ref: str | None = None,
) -> None:
    """processing (this attempt) -> succeeded, with the handler's result reference (None:
    none), and the route's outcome appended to the ledger in the same
    statement (:mod:`models.ledger`). Raises IllegalTransition if the lease was lost.

    On a session it commits with the handler's writes; on a psycopg connection in autocommit
    (a handler that wrote nothing through ``ctx.session``) it is one synchronous commit.
    ``leaf`` as for :func:`claim_with_event`."""
    _guarded_finish(
        session,
        found,
        "succeed",
        "status = 'succeeded', succeeded_at = :now, next_attempt_at = NULL, "
        "last_error = NULL, last_error_class = NULL, result_ref = :result_ref",
        now=now,
        outcome=AttemptOutcome.SUCCEEDED,
        params={"result_ref": result_ref},
        leaf=leaf,
        final=ledger.succeeded(),
    )


def retry_later(
    session: Session,
    found: Claim,
    *,
    now: datetime,
    next_attempt_at: datetime,
    error_class: str,
    error: str,
    uncounted: bool = False,
) -> None:
    """processing (this attempt) -> retrying, due at ``next_attempt_at``. ``uncounted``: a
    failed breaker probe (models/breaker.py), which the retry policy does not count
    (``attempt_base`` + 1), so an outage never spends a delivery's ``max_attempts``."""
    _guarded_finish(
        session,
        found,
        "retry",
        "status = 'retrying', next_attempt_at = :next_at, "
        "last_error_class = :error_class, last_error = :error"
        + (", attempt_base = attempt_base + 1" if uncounted else ""),
        now=now,
        outcome=AttemptOutcome.RETRY,
        error_class=error_class,
        error=error,
        params={"next_at": next_attempt_at},
    )


def kill(
    session: Session,
    found: Claim,
    *,
    now: datetime,
    reason: str,
    error_class: str | None,
    error: str | None,
) -> None:
    """processing (this attempt) -> dead, with the reason and the last error; the dead
    letter is the route's outcome in the ledger until a replay ends it again."""
    _guarded_finish(
        session,
        found,
        "dead",
        "status = 'dead', dead_reason = :reason, dead_at = :now, next_attempt_at = NULL, "
        "last_error_class = coalesce(:error_class, last_error_class), "
        "last_error = coalesce(:error, last_error)",
        now=now,
        outcome=AttemptOutcome.DEAD,
        error_class=error_class,
        error=error,
        params={"reason": reason},
        final=ledger.dead(),
    )


def filter_out(session: Target, found: Claim, *, now: datetime, reason: str) -> None:
    """processing (this attempt) -> filtered: the route's transform dropped the event
    (tasks.transforms), its handler never called; ``reason`` names the transform, as the
    accept's ``filtered`` deliveries name the filter. Final, like those, and like those
    replayed only when chosen by id; its route's outcome in the ledger (code ``f``, same
    statement); those the accept filtered get theirs at their expiry (models.ledger)."""
    _guarded_finish(
        session,
        found,
        "filter",
        "status = 'filtered', next_attempt_at = NULL, "
        "last_error_class = 'filtered', last_error = :reason",
        now=now,
        outcome=AttemptOutcome.FILTERED,
        params={"reason": reason},
        final=ledger.filtered(),
    )


def supersede(
    session: Target,
    found: Claim,
    *,
    now: datetime,
    newer_event_id: str,
    leaf: str | None = None,
) -> None:
    """processing (this attempt) -> superseded: a newer event of its lane already succeeded
    on the route (models/lanes.py); its handler was not called. Final, with the newer
    event's id in ``last_error`` and its route's outcome in the ledger (same statement)."""
    _guarded_finish(
        session,
        found,
        "supersede",
        "status = 'superseded', next_attempt_at = NULL, last_error_class = 'superseded', "
        "last_error = :newer",
        now=now,
        outcome=AttemptOutcome.SUPERSEDED,
        error_class="superseded",
        error=f"superseded by event {newer_event_id}",
        params={"newer": f"superseded by event {newer_event_id}"},
        leaf=leaf,
        final=ledger.superseded(),
    )
