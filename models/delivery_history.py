"""A delivery's history as operators read it: its attempts in time order and the replays
(with their audit rows) that split them into runs. Read-only, like :mod:`models.queries`."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from core.states import AttemptOutcome
from models.schema import (
    Attempt,
    Delivery,
    Receipt,
    Replay,
    Route,
)

# The named windows of :attr:`DeliveryView.repeat_windows` (the causes of the
# ``webhooks_repeat_windows_total`` metric).
LEASE_TAKEN_OVER = "lease taken over: its worker was lost holding the lease"
ANSWER_TIMEOUT = "answer timed out: the call was sent, its answer did not come in time"


@dataclass(frozen=True)
class AttemptView:
    """One try of a delivery: who ran it, when, and how it ended. ``number`` is the attempt's
    fencing token: it only grows, across replays and re-runs too."""

    number: int
    generation: int
    worker: str | None
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    error_class: str | None
    error: str | None
    # When the outcome's statement ran (0020): for a success, how long after the handler
    # returned (the downstream's 2xx) its effect was recorded.
    committed_at: datetime | None = None

    @property
    def unrecorded_ms(self) -> int | None:
        """Milliseconds from the handler's return to the outcome's commit (None: not known)."""
        if self.committed_at is None or self.ended_at is None:
            return None
        return max(0, int((self.committed_at - self.ended_at).total_seconds() * 1000))


@dataclass(frozen=True)
class ReplayMark:
    """A replay (or re-run) that moved a delivery: the attempts from ``first_attempt`` on
    belong to it (None: none has started since). The audit fields are None when no audit row
    accounts for it (a replay older than the ``replays`` rows kept)."""

    replay_id: int | None
    operator: str | None
    reason: str | None
    via: str | None
    started_at: datetime | None
    rerun: bool
    first_attempt: int | None


@dataclass(frozen=True)
class DeliveryView:
    """One (event, route) unit of work with its attempts (in time order) and the replays that
    split them into runs."""

    id: int
    route_id: int
    handler: str  # REMOVED_ROUTE once the route is gone
    status: str
    attempts: int  # the latest attempt's number (the fencing token; goes on across replays)
    attempts_since_replay: int  # what the retry policy counts: attempts - attempt_base
    generation: int
    dead_reason: str | None
    last_error_class: str | None
    last_error: str | None
    next_attempt_at: datetime | None  # None once finished
    created_at: datetime
    updated_at: datetime
    succeeded_at: datetime | None
    result_ref: str | None = None  # what its handler returned with the success (0021)
    attempt_log: list[AttemptView] = field(default_factory=list)
    replays: list[ReplayMark] = field(default_factory=list)

    @property
    def repeat_windows(self) -> list[tuple[int, str]]:
        """The attempts whose call may have reached the downstream although another attempt
        of the same key generation ran after them, each with its named window: the only
        ways one delivery reaches its downstream twice (docs/workers.md)."""
        out = []
        for a, later in zip(self.attempt_log, self.attempt_log[1:], strict=False):
            if later.generation != a.generation:
                continue
            if a.outcome == "crashed":
                out.append((a.number, LEASE_TAKEN_OVER))
            elif a.error_class == "SoftTimeLimitExceeded" or (a.error or "").startswith(
                ("timeout:", "hard_time_limit:")
            ):
                out.append((a.number, ANSWER_TIMEOUT))
        return out


def delivery_views(session: Session, r: Any, *, only: int | None = None) -> list[DeliveryView]:
    conds = [Delivery.receipt_id == r.id, Delivery.expires_at == r.expires_at]
    if only is not None:
        conds.append(Delivery.id == only)
    deliveries = session.execute(
        select(Delivery, func.coalesce(Route.handler, REMOVED_ROUTE))
        .outerjoin(Route, Route.id == Delivery.route_id)
        .where(*conds)
        .order_by(Delivery.id)
    ).all()
    if not deliveries:
        return []
    attempts: dict[int, list[AttemptView]] = {d.id: [] for d, _ in deliveries}
    for a in session.scalars(
        select(Attempt)
        .where(Attempt.delivery_id.in_(list(attempts)), Attempt.expires_at == r.expires_at)
        # Time order; the number breaks ties (it only grows, across replays too).
        .order_by(Attempt.delivery_id, Attempt.started_at, Attempt.number, Attempt.id)
    ):
        attempts[a.delivery_id].append(
            AttemptView(
                a.number,
                a.generation,
                a.worker,
                a.started_at,
                a.ended_at,
                a.outcome,
                a.error_class,
                a.error_message,
                a.committed_at,
            )
        )
    first_created = min(d.created_at for d, _ in deliveries)
    audit = _replays_since(session, first_created, list(attempts))
    return [
        DeliveryView(
            id=d.id,
            route_id=d.route_id,
            handler=handler,
            status=d.status,
            attempts=d.attempts,
            attempts_since_replay=d.attempts - d.attempt_base,
            generation=d.generation,
            dead_reason=d.dead_reason,
            last_error_class=d.last_error_class,
            last_error=d.last_error,
            next_attempt_at=d.next_attempt_at,
            created_at=d.created_at,
            updated_at=d.updated_at,
            succeeded_at=d.succeeded_at,
            result_ref=d.result_ref,
            attempt_log=attempts[d.id],
            replays=replay_marks(
                attempts[d.id],
                [a for a in audit if a.could_have_moved(d.id, r.public_id, r.name, r.event_type)],
                attempt_base=d.attempt_base,
            ),
        )
        for d, handler in deliveries
    ]


@dataclass(frozen=True)
class ReplayAudit:
    """A ``replays`` row, as far as attributing it to a delivery needs."""

    id: int
    operator: str
    reason: str
    via: str
    started_at: datetime
    rerun: bool
    filter: dict[str, Any]

    def names(self, delivery_id: int) -> bool:
        return delivery_id in (self.filter.get("ids") or [])

    def could_have_moved(
        self, delivery_id: int, source: str, source_name: str, event_type: str
    ) -> bool:
        """Named by id, or a filter replay whose filter (as given) matches the event."""
        if "ids" in self.filter:
            return self.names(delivery_id)
        given_source = self.filter.get("source")
        if given_source is not None and given_source not in (source, source_name):
            return False
        pattern = self.filter.get("type")
        return pattern is None or fnmatch.fnmatchcase(event_type, str(pattern))


def _replays_since(session: Session, since: datetime, ids: list[int]) -> list[ReplayAudit]:
    rows = session.scalars(
        select(Replay)
        .where(
            Replay.started_at >= since,
            or_(
                ~Replay.filter.has_key("ids"),
                *(Replay.filter["ids"].contains([i]) for i in ids),
            ),
        )
        .order_by(Replay.started_at, Replay.id)
    )
    return [
        ReplayAudit(r.id, r.operator, r.reason, r.via, r.started_at, r.rerun_succeeded, r.filter)
        for r in rows
    ]


def replay_marks(
    attempts: Sequence[AttemptView], audit: Sequence[ReplayAudit], *, attempt_base: int
) -> list[ReplayMark]:
    """Where replays split a delivery's attempts (in time order) into runs, and which audit
    row each was (pure).

    A new run starts at an attempt that follows a finished one (its predecessor ended
    ``dead`` or ``succeeded``), carries a new key generation (a re-run), or is the first
    after ``attempt_base`` (the latest replay; this also finds a replay of a delivery that
    went dead by crashing, whose last attempt says ``crashed``); a replay that names the
    delivery between two of its attempts marks one too. A replay whose attempt has not
    started yet is a mark at the end. Each mark takes the earliest replay that could have
    moved the delivery after the run before it had started (one naming it by id first):
    later ones could only have found it no longer dead.
    """
    starts: list[int] = []  # indexes of attempts that open a run
    for i in range(1, len(attempts)):
        prev, cur = attempts[i - 1], attempts[i]
        if (
            prev.outcome in (AttemptOutcome.DEAD, AttemptOutcome.SUCCEEDED)
            or cur.generation > prev.generation
            or (attempt_base > 0 and cur.number == attempt_base + 1)
            or any(
                prev.started_at < a.started_at <= cur.started_at and "ids" in a.filter
                for a in audit
            )
        ):
            starts.append(i)
    pending_replay = attempt_base > 0 and not any(a.number > attempt_base for a in attempts)
    if pending_replay and attempts:
        starts.append(len(attempts))
    marks: list[ReplayMark] = []
    for k, i in enumerate(starts):
        after = attempts[i - 1].started_at
        # The run it opens ends where the next run's last attempt before it starts.
        until = attempts[starts[k + 1] - 1].started_at if k + 1 < len(starts) else None
        window = [
            a for a in audit if a.started_at > after and (until is None or a.started_at <= until)
        ]
        window.sort(key=lambda a: ("ids" not in a.filter, a.started_at, a.id))
        first = attempts[i].number if i < len(attempts) else None
        rerun = i < len(attempts) and attempts[i].generation > attempts[i - 1].generation
        if window:
            a = window[0]
            marks.append(
                ReplayMark(a.id, a.operator, a.reason, a.via, a.started_at, a.rerun or rerun, first)
            )
        else:
            marks.append(ReplayMark(None, None, None, None, None, rerun, first))
    return marks


def delivery_of_receipt() -> Any:
    return and_(Delivery.receipt_id == Receipt.id, Delivery.expires_at == Receipt.expires_at)


# The handler shown for a delivery whose route was removed (``webhooks routes remove``).
REMOVED_ROUTE = "(route removed)"
