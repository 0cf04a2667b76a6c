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
fencing token: a worker whose lease expired and was re-claimed can no longer finish.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session


def _placeholders(sql: str) -> str:
    """``:name`` (this module's notation) -> psycopg's ``%(name)s``; ``::`` casts untouched."""
    return re.sub(r"(?<![:\w]):([a-z_]+)", r"%(\1)s", sql)


def _fetchone(session: Session, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """Run a hot-path statement on the session's own connection and transaction, through
    psycopg directly: on a worker, SQLAlchemy's result machinery cost more CPU than the
    statements themselves (tuple rows, no per-result column metadata). Handler writes made
    through the same session commit or roll back with it."""
    raw = session.connection().connection.driver_connection
    assert raw is not None
    row: tuple[Any, ...] | None = raw.execute(sql, params).fetchone()
    return row


class TransitionError(Exception):
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
    lease_until: datetime
    status: str  # "processing", or "dead" when this claim found one crash too many

    @property
    def crashed_too_often(self) -> bool:
        return self.status == "dead"


# One statement: the guarded claim, the previous attempt marked crashed when its worker died
# holding the lease, and this attempt's row. (All parts see one snapshot; a successful claim
# leaves no live attempt behind it, so any attempt still open then belongs to a dead worker.)
_CLAIM_SQL = """
    WITH claimed AS (
        UPDATE deliveries SET
            redeliveries = redeliveries + CASE WHEN status = 'processing' THEN 1 ELSE 0 END,
            status = CASE
                WHEN status = 'processing' AND redeliveries + 1 >= :max_redeliveries THEN 'dead'
                ELSE 'processing' END,
            dead_reason = CASE
                WHEN status = 'processing' AND redeliveries + 1 >= :max_redeliveries
                THEN 'crashed' ELSE dead_reason END,
            attempts = attempts + CASE
                WHEN status = 'processing' AND redeliveries + 1 >= :max_redeliveries
                THEN 0 ELSE 1 END,
            lease_until = :now + :lease,
            next_attempt_at = :now + :lease,
            first_attempt_at = coalesce(first_attempt_at, :now),
            updated_at = :now
        WHERE id = :id {expires_match}
          AND (status = 'pending'
               OR (status = 'retrying' AND next_attempt_at <= :now)
               OR (status = 'processing' AND lease_until <= :now))
        RETURNING id, expires_at, receipt_id, source_id, route_id, attempts, redeliveries,
                  generation, created_at, first_attempt_at, lease_until, status
    ), crashed AS (
        UPDATE attempts SET outcome = 'crashed', ended_at = :now,
            error_class = 'WorkerLost', error_message = 'lease expired while processing'
        WHERE delivery_id = :id AND expires_at = {attempt_expiry}
          AND ended_at IS NULL
    ), started AS (
        INSERT INTO attempts (expires_at, delivery_id, number, generation, worker, started_at)
        SELECT expires_at, id, attempts, generation, :worker, :now
        FROM claimed WHERE status = 'processing'
    )
    SELECT * FROM claimed
    """


# With the delivery's expires_at known (the worker reads it with the key generation) the claim
# touches one partition; by id alone it probes every partition's index.
_CLAIM = _placeholders(
    _CLAIM_SQL.format(expires_match="", attempt_expiry="(SELECT expires_at FROM claimed)")
)
_CLAIM_IN_PARTITION = _placeholders(
    _CLAIM_SQL.format(expires_match="AND expires_at = :expires_at", attempt_expiry=":expires_at")
)


def claim(
    session: Session,
    delivery_id: int,
    *,
    now: datetime,
    lease: timedelta,
    max_redeliveries: int,
    worker: str,
    expires_at: datetime | None = None,
) -> Claim | None:
    """pending | retrying (due) | processing (lease expired) -> processing, attempts + 1.

    Returns None when the delivery is done, dead, not yet due, or owned by a live lease.
    A claim that finds an expired lease counts a redelivery (the previous holder died) and
    records that attempt as crashed; at ``max_redeliveries`` it goes dead instead. One
    statement, one round trip; pass the delivery's ``expires_at`` when known (one partition).
    """
    row = _fetchone(
        session,
        _CLAIM if expires_at is None else _CLAIM_IN_PARTITION,
        {
            "expires_at": expires_at,
            "id": delivery_id,
            "now": now,
            "lease": lease,
            "max_redeliveries": max_redeliveries,
            "worker": worker,
        },
    )
    return None if row is None else Claim(*row)


@functools.cache
def _finish_sql(assignments: str) -> str:
    """The finishing statement for one transition's assignments (built once per transition)."""
    return _placeholders(
        f"""
        WITH done AS (
            UPDATE deliveries SET {assignments}, lease_until = NULL, updated_at = :now
            WHERE id = :id AND expires_at = :expires_at AND status = 'processing'
              AND attempts = :attempt AND generation = :generation
            RETURNING id
        ), ended AS (
            UPDATE attempts SET ended_at = :now, outcome = :outcome,
                error_class = :error_class, error_message = :error
            WHERE delivery_id = :id AND expires_at = :expires_at AND number = :attempt
              AND generation = :generation AND ended_at IS NULL
              AND EXISTS (SELECT 1 FROM done)
        )
        SELECT id FROM done
        """  # noqa: S608 (assignments are literals of this module)
    )


def _guarded_finish(
    session: Session,
    found: Claim,
    transition: str,
    assignments: str,
    *,
    now: datetime,
    outcome: str,
    error_class: str | None = None,
    error: str | None = None,
    params: dict[str, Any] | None = None,
) -> None:
    """One statement: the guarded state change and the end of this attempt's row."""
    sql = _finish_sql(assignments)
    row = _fetchone(
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


def succeed(session: Session, found: Claim, *, now: datetime) -> None:
    """processing (this attempt) -> succeeded. Raises IllegalTransition if the lease was lost."""
    _guarded_finish(
        session,
        found,
        "succeed",
        "status = 'succeeded', succeeded_at = :now, next_attempt_at = :now, "
        "last_error = NULL, last_error_class = NULL",
        now=now,
        outcome="succeeded",
    )


def retry_later(
    session: Session,
    found: Claim,
    *,
    now: datetime,
    next_attempt_at: datetime,
    error_class: str,
    error: str,
) -> None:
    """processing (this attempt) -> retrying, due at ``next_attempt_at``."""
    _guarded_finish(
        session,
        found,
        "retry",
        "status = 'retrying', next_attempt_at = :next_at, "
        "last_error_class = :error_class, last_error = :error",
        now=now,
        outcome="retry",
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
    """processing (this attempt) -> dead, with the reason and the last error."""
    _guarded_finish(
        session,
        found,
        "dead",
        "status = 'dead', dead_reason = :reason, next_attempt_at = :now, "
        "last_error_class = coalesce(:error_class, last_error_class), "
        "last_error = coalesce(:error, last_error)",
        now=now,
        outcome="dead",
        error_class=error_class,
        error=error,
        params={"reason": reason},
    )


def replay(session: Session, delivery_id: int, *, now: datetime, publish_grace: timedelta) -> bool:
    """dead -> pending, keeping the key generation; attempts and the max-age clock start
    again. False when it was not dead (someone else replayed it first, or another state)."""
    row = session.execute(
        text(
            """
            UPDATE deliveries SET status = 'pending', attempts = 0, redeliveries = 0,
                dead_reason = NULL, first_attempt_at = NULL,
                next_attempt_at = :now + :grace, updated_at = :now
            WHERE id = :id AND status = 'dead'
            RETURNING id
            """
        ),
        {"id": delivery_id, "now": now, "grace": publish_grace},
    ).one_or_none()
    return row is not None


def rerun(session: Session, delivery_id: int, *, now: datetime, publish_grace: timedelta) -> bool:
    """succeeded -> pending with generation + 1, so downstreams see a new idempotency key."""
    row = session.execute(
        text(
            """
            UPDATE deliveries SET status = 'pending', attempts = 0, redeliveries = 0,
                generation = generation + 1, succeeded_at = NULL, first_attempt_at = NULL,
                next_attempt_at = :now + :grace, updated_at = :now
            WHERE id = :id AND status = 'succeeded'
            RETURNING id
            """
        ),
        {"id": delivery_id, "now": now, "grace": publish_grace},
    ).one_or_none()
    return row is not None


def due_for_publish(session: Session, *, now: datetime, grace: timedelta, limit: int) -> list[int]:
    """The sweeper's pick, claimed with SKIP LOCKED so two sweepers never take the same rows:

    - pending deliveries whose publish grace passed (never published, or the message was lost);
    - retrying deliveries due more than ``grace`` ago (their countdown message did not come,
      or the delay was too long for a countdown), moved back to pending;
    - processing deliveries whose lease expired (the worker died), left processing so the
      claim counts the redelivery.

    Each picked row's next_attempt_at moves ``grace`` ahead, so a backlog is re-published at
    most once per grace period. The caller publishes after committing.
    """
    rows = session.execute(
        text(
            """
            WITH due AS (
                SELECT id, expires_at FROM deliveries
                WHERE next_attempt_at <= :now
                  AND (status = 'pending'
                       OR (status = 'retrying' AND next_attempt_at <= :now - :grace)
                       OR (status = 'processing' AND lease_until <= :now))
                ORDER BY next_attempt_at
                LIMIT :limit
                FOR UPDATE SKIP LOCKED
            )
            UPDATE deliveries d SET
                status = CASE WHEN d.status = 'retrying' THEN 'pending' ELSE d.status END,
                next_attempt_at = :now + :grace,
                updated_at = :now
            FROM due WHERE d.id = due.id AND d.expires_at = due.expires_at
            RETURNING d.id
            """
        ),
        {"now": now, "grace": grace, "limit": limit},
    ).all()
    return [r[0] for r in rows]
