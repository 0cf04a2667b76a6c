"""The transitions that put a delivery back in line, or take it out, guarded like every
other (:mod:`models.transitions`): an operator's replay (dead -> pending; filtered -> pending,
only for deliveries named by id; retrying held for drift -> pending, likewise), re-run
(succeeded -> pending, generation + 1) and discard (dead -> discarded), and the sweeper's
pick of the deliveries whose message was lost (:func:`due_for_publish`). Time as there: the
database's clock unless a test pins ``now``."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.states import DRIFT_HELD, DRIFT_REPLAYED, DeliveryStatus
from models import lanes, ledger
from models.statements import sql_text


def _back_to_pending(
    session: Session,
    delivery_id: int,
    leaving: str,
    resets: str,
    now: datetime | None,
    grace: timedelta,
) -> bool:
    """One guarded move of one delivery from ``leaving`` to pending (``resets``: what the
    move clears besides the run's counters); False when the row was not in ``leaving``."""
    row = session.execute(
        sql_text(
            f"""
            UPDATE deliveries SET status = 'pending', attempt_base = attempts, redeliveries = 0,
                {resets}, first_attempt_at = NULL,
                next_attempt_at = :now + :grace, updated_at = :now
            WHERE id = :id AND status = '{leaving}'
            RETURNING id
            """  # noqa: S608 (literals of this module)
        ),
        {"id": delivery_id, "now": now, "grace": grace},
    ).one_or_none()
    return row is not None


def replay(
    session: Session, delivery_id: int, *, now: datetime | None, publish_grace: timedelta
) -> bool:
    """dead -> pending, keeping the key generation; the policy's attempt count and the
    max-age clock start again, the attempt number (the fencing token) goes on. False when it
    was not dead (someone else replayed it first, or another state)."""
    resets = "dead_reason = NULL, dead_at = NULL"
    return _back_to_pending(session, delivery_id, DeliveryStatus.DEAD, resets, now, publish_grace)


def rerun(
    session: Session, delivery_id: int, *, now: datetime | None, publish_grace: timedelta
) -> bool:
    """succeeded -> pending with generation + 1, so downstreams see a new idempotency key;
    the attempt number goes on, as for a replay."""
    resets = "generation = generation + 1, succeeded_at = NULL"
    return _back_to_pending(
        session, delivery_id, DeliveryStatus.SUCCEEDED, resets, now, publish_grace
    )


# An operator's replay of many deliveries at once (models.replays): per row, the guarded move
# of :func:`replay` (from dead) or :func:`rerun` (from succeeded: generation + 1), only while
# its receipt still holds the payload (the receipt shares the delivery's expires_at). The ids
# as one array: one index scan per partition, where a join with the list probed every
# partition once per id; the payload check as a scalar subquery, looked up per row by the
# receipt's key, where an EXISTS was planned as a hash join over every receipt.
_REPLAY_MANY_SQL = """
    UPDATE deliveries d SET status = 'pending', attempt_base = d.attempts, redeliveries = 0,
        generation = d.generation + :bump, succeeded_at = NULL, dead_reason = NULL,
        dead_at = NULL, first_attempt_at = NULL, next_attempt_at = :now + :grace,
        updated_at = :now,
        last_error_class = CASE WHEN d.status IN ('filtered', 'superseded') THEN NULL
                                ELSE d.last_error_class END,
        last_error = CASE WHEN d.status IN ('filtered', 'superseded') THEN NULL
                          ELSE d.last_error END
    WHERE d.id = ANY(CAST(:ids AS bigint[])) AND d.status = :status
      AND (SELECT r.payload IS NOT NULL FROM receipts r
           WHERE r.id = d.receipt_id AND r.expires_at = d.expires_at)
    RETURNING d.id
    """

# A delivery a quarantined route holds for drift (retrying, ``DriftHeld``: docs/drift.md),
# replayed by its id: pending as :func:`replay` would make it, keeping its key generation
# (the hold made no call), its error class turned into the mark that check_drift lets run
# (``DriftReplayed``). Guarded on the hold itself: a row the worker's recheck claimed first
# (processing), or a drift accept released and a worker ran, does not move; a claim that
# comes after sees the mark. Only while the receipt still holds the payload.
_REPLAY_HELD_SQL = """
    UPDATE deliveries d SET status = 'pending', attempt_base = d.attempts, redeliveries = 0,
        first_attempt_at = NULL, next_attempt_at = :now + :grace, updated_at = :now,
        last_error_class = :mark,
        last_error = 'replayed past its drift hold: ' || coalesce(d.last_error, '')
    WHERE d.id = ANY(CAST(:ids AS bigint[])) AND d.status = 'retrying'
      AND d.last_error_class = :held
      AND (SELECT r.payload IS NOT NULL FROM receipts r
           WHERE r.id = d.receipt_id AND r.expires_at = d.expires_at)
    RETURNING d.id
    """


def replay_many(
    session: Session,
    wanted: list[tuple[int, str]],
    *,
    now: datetime | None,
    publish_grace: timedelta,
) -> set[int]:
    """:func:`replay` (``dead``, and ``filtered``: a delivery its route's filter kept from
    running, replayed on purpose, its filter's reason cleared) and :func:`rerun`
    (``succeeded``), and the replay of a delivery held for drift (``retrying``, guarded on
    its hold: :data:`_REPLAY_HELD_SQL`), for many (delivery id, status the plan saw) pairs,
    one statement per status, each row guarded on its own; a row whose payload retention
    dropped is not moved. Returns the ids that moved (the others: the caller asks why). Run
    it in a transaction of its own: it turns JIT compilation off there (planning a statement
    over every partition, Postgres would spend seconds compiling it)."""
    session.execute(text("SET LOCAL jit = off"))
    moved: set[int] = set()
    for status, bump in (
        (DeliveryStatus.DEAD, 0),
        (DeliveryStatus.SUCCEEDED, 1),
        (DeliveryStatus.FILTERED, 0),
        (DeliveryStatus.SUPERSEDED, 0),
    ):
        ids = [i for i, seen in wanted if seen == status]
        if ids:
            rows = session.execute(
                sql_text(_REPLAY_MANY_SQL),
                {
                    "ids": ids,
                    "status": status,
                    "bump": bump,
                    "now": now,
                    "grace": publish_grace,
                },
            ).all()
            moved |= {int(r[0]) for r in rows}
    held = [i for i, seen in wanted if seen == DeliveryStatus.RETRYING]
    if held:
        rows = session.execute(
            sql_text(_REPLAY_HELD_SQL),
            {
                "ids": held,
                "now": now,
                "grace": publish_grace,
                "held": DRIFT_HELD,
                "mark": DRIFT_REPLAYED,
            },
        ).all()
        moved |= {int(r[0]) for r in rows}
    return moved


# The discard, and each discarded route's outcome appended to the ledger (``x``).
_DISCARD_SQL = f"""
    WITH discarded AS (
        UPDATE deliveries SET status = 'discarded', next_attempt_at = NULL, updated_at = :now
        WHERE id = ANY(:ids) AND status = 'dead'
        RETURNING id, receipt_id, expires_at, {ledger.discarded()} AS outcome
    ), {ledger.append("discarded")}
    SELECT id FROM discarded
    """  # noqa: S608 (fragments of models.ledger, no input)


def discard(session: Session, delivery_ids: list[int], *, now: datetime | None) -> list[int]:
    """dead -> discarded (an operator's audited decision): no longer a dead letter, so
    retention no longer holds it, and ``x`` is its route's outcome in the ledger (same
    statement). Returns the ids that were dead (others are left alone)."""
    rows = session.execute(
        sql_text(_DISCARD_SQL),
        {"ids": list(delivery_ids), "now": now},
    ).all()
    return sorted(int(r[0]) for r in rows)


class Due(NamedTuple):
    """A delivery the sweeper picked."""

    delivery_id: int
    event_id: str | None
    source: str | None
    # A processing row whose worker died holding it: published alone (one id per message),
    # so that a handler that kills its worker takes no batch-mate with it next time.
    lease_expired: bool


def due_for_publish(
    session: Session,
    *,
    now: datetime | None,
    grace: timedelta,
    limit: int,
    admitted: Sequence[int] = (),
) -> list[Due]:
    """The sweeper's pick, claimed with SKIP LOCKED so two sweepers never take the same rows:

    - pending deliveries whose publish grace passed (never published, or the message was lost);
    - retrying deliveries due more than ``grace`` ago (their countdown message did not come,
      or the delay was too long for a countdown), moved back to pending;
    - processing deliveries whose lease expired (the worker died), left processing so the
      claim counts the redelivery.

    Each picked row's next_attempt_at moves ``grace`` ahead, so a backlog is re-published at
    most once per grace period, and its ``republished`` count (reset by the claim) goes up: a
    pending row re-published twice is claimed through Postgres whatever its fast-claim key
    says (the worker's probe), since the moved next_attempt_at never looks overdue to it.
    ``admitted``: deliveries admission holds (waiting for their route's limits, or in
    flight: models/admission.py). They are not lost and are left alone.

    The caller publishes after committing. Returns each one's delivery id, event id and source
    public id (so the message shows what it carries), and whether its lease expired.
    """
    rows = session.execute(
        sql_text(
            """
            WITH due AS (
                SELECT id, expires_at FROM deliveries
                WHERE next_attempt_at <= :now
                  AND (status = 'pending'
                       OR (status = 'retrying' AND next_attempt_at <= :now - :grace)
                       OR (status = 'processing' AND lease_until <= :now))
                  -- held: the route is paused or its breaker not closed (its probe is
                  -- picked by models.breaker.pick_probes, not here)
                  AND NOT EXISTS (
                      SELECT 1 FROM routes g WHERE g.id = deliveries.route_id
                        AND (g.paused_at IS NOT NULL OR g.breaker_state <> 'closed'))
                  AND id NOT IN (SELECT unnest(CAST(:admitted AS bigint[])))
                  -- a delivery its lane holds back is not lost: the end of the delivery
                  -- ahead of it publishes it (models/lanes.py); only heads are picked
                  AND <lane-guard>
                ORDER BY next_attempt_at
                LIMIT :limit
                FOR UPDATE SKIP LOCKED
            ), picked AS (
                UPDATE deliveries d SET
                    status = CASE WHEN d.status = 'retrying' THEN 'pending' ELSE d.status END,
                    next_attempt_at = :now + :grace,
                    republished = d.republished + 1,
                    updated_at = :now
                FROM due WHERE d.id = due.id AND d.expires_at = due.expires_at
                RETURNING d.id, d.receipt_id, d.expires_at, d.source_id, d.status
            )
            SELECT p.id, r.event_id, s.public_id, p.status = 'processing' FROM picked p
            LEFT JOIN receipts r ON r.id = p.receipt_id AND r.expires_at = p.expires_at
            LEFT JOIN sources s ON s.id = p.source_id
            ORDER BY p.id
            """.replace("<lane-guard>", lanes.guard("deliveries"))
        ),
        {"now": now, "grace": grace, "limit": limit, "admitted": list(admitted)},
    ).all()
    return [Due(int(r[0]), r[1], r[2], bool(r[3])) for r in rows]
