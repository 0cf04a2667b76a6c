"""Operator discards of dead letters, shared by the CLI (and any later API): plan, execute, audit.

A dead letter is kept for ``dead_letter_retention`` after it went dead, so an operator can
inspect and replay it; an operator who decides it will never be replayed discards it:
``dead -> discarded`` (:func:`models.requeue.discard`, guarded on ``dead``), after which
retention no longer holds it. The state change, its ``audit_log`` row (who, why, the
filter as given, how many) and its ``audit_discarded`` rows (which deliveries: a filter
matches other rows tomorrow, so the filter alone does not say what was discarded) commit in
one transaction; the log line and the metric carry the count only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.orm import Session

from core.errors import WebhooksError
from core.logs import get_logger
from core.states import DeliveryStatus
from models import requeue
from models.candidates import (
    Candidate,
    ReplayFilter,
    candidates_by_filter,
    candidates_by_ids,
)

log = get_logger("discards")

MAX_PLAN = 100_000  # dead letters in one discard; narrow the filter beyond that
SAMPLE_SIZE = 10

Via = Literal["cli", "api", "console"]


class DiscardError(WebhooksError, ValueError):
    """The discard was refused or is malformed; nothing was changed."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DiscardRequest:
    operator: str
    reason: str
    via: Via
    filter_as_given: dict[str, Any]  # stored verbatim in the audit row
    ids: tuple[int, ...] = ()
    flt: ReplayFilter | None = None  # status is always "dead"


@dataclass(frozen=True)
class DiscardPlan:
    request: DiscardRequest
    candidates: tuple[Candidate, ...]

    @property
    def count(self) -> int:
        return len(self.candidates)

    @property
    def sample(self) -> tuple[Candidate, ...]:
        return self.candidates[:SAMPLE_SIZE]


@dataclass(frozen=True)
class DiscardResult:
    audit_id: int
    planned: int
    discarded: int  # no longer dead by the time it ran (replayed meanwhile): not counted


def _validate(req: DiscardRequest) -> None:
    if not req.reason.strip():
        raise DiscardError(
            "a reason is required (--reason): it goes into the audit record", "no_reason"
        )
    if not req.operator.strip():
        raise DiscardError("an operator name is required (--operator)", "no_operator")
    if bool(req.ids) == (req.flt is not None):
        raise DiscardError(
            "give delivery ids or a filter (--source/--type/...), not both", "bad_target"
        )
    if req.flt is not None and req.flt.status != DeliveryStatus.DEAD:
        raise DiscardError("only dead letters can be discarded", "not_dead")


def plan_discard(session: Session, req: DiscardRequest) -> DiscardPlan:
    """Select and freeze the dead letters to discard. Read-only; refuses ids that are not
    dead (nothing else may be discarded)."""
    _validate(req)
    if req.ids:
        found = candidates_by_ids(session, req.ids)
        alive = [c for c in found if c.status != DeliveryStatus.DEAD]
        if alive:
            listed = ", ".join(f"{c.delivery_id} ({c.status})" for c in alive[:10])
            raise DiscardError(
                f"refused: delivery {listed} is not a dead letter; only dead deliveries "
                "can be discarded",
                "not_dead",
            )
    else:
        assert req.flt is not None
        found = candidates_by_filter(session, req.flt, limit=MAX_PLAN + 1)
    if len(found) > MAX_PLAN:
        raise DiscardError(
            f"more than {MAX_PLAN} dead letters match; narrow the filter (--since/--until/--type)",
            "too_many",
        )
    return DiscardPlan(req, tuple(found))


_AUDIT = text(
    """
    INSERT INTO audit_log (at, operator, action, target, reason, count, via)
    VALUES (coalesce(CAST(:now AS timestamptz), now()), :operator, 'discard',
            CAST(:target AS jsonb), :reason, :count, :via)
    RETURNING id
    """
)

# The ids the discard changed, one row each, under its audit row.
_AUDIT_IDS = text(
    """
    INSERT INTO audit_discarded (audit_id, delivery_id)
    SELECT :audit_id, unnest(CAST(:ids AS bigint[]))
    """
)


def execute_discard(session: Session, plan: DiscardPlan, *, now: datetime | None) -> DiscardResult:
    """dead -> discarded for the planned deliveries still dead, and the audit row with the
    ids it changed, in the caller's transaction (the session's). ``now`` None: the
    database's clock."""
    req = plan.request
    done = requeue.discard(session, [c.delivery_id for c in plan.candidates], now=now)
    audit_id = session.execute(
        _AUDIT,
        {
            "now": now,
            "operator": req.operator,
            "target": json.dumps(req.filter_as_given, default=str, sort_keys=True),
            "reason": req.reason,
            "count": len(done),
            "via": req.via,
        },
    ).scalar_one()
    if done:
        session.execute(_AUDIT_IDS, {"audit_id": audit_id, "ids": done})
    return DiscardResult(audit_id=int(audit_id), planned=plan.count, discarded=len(done))


def record_discarded(result: DiscardResult, via: Via) -> None:
    """After the commit: the log line and the metric (counts only)."""
    log.info(
        "dead_letters_discarded",
        audit_id=result.audit_id,
        count=result.discarded,
        planned=result.planned,
        via=via,
    )
    if result.discarded:
        # Imported here, as in models.retention: the metrics module is imported late.
        from core.metrics import DEAD_LETTERS_DISCARDED  # noqa: PLC0415 (see above)

        DEAD_LETTERS_DISCARDED.labels(via="operator").inc(result.discarded)
