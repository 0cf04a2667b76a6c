"""Operator replays, shared by the CLI and the admin API: plan, preview, execute, audit.

1. :func:`plan_replay` selects the candidates once (by ids, or by filter) and freezes their ids:
   what the preview counted is exactly what runs. It refuses, changing nothing, a plain replay
   of a succeeded delivery (its effect would run again under the same downstream key) and
   deliveries that are still being worked on.
2. :func:`start_replay` writes the audit row (who, why, the filter as given, planned count).
3. :func:`execute` moves the deliveries in chunks, each chunk one transaction: one set-based
   statement (:func:`models.requeue.replay_many`: per row the guarded ``replay``, dead ->
   pending with the same key generation, or ``rerun``, succeeded -> pending with generation
   + 1), one read of why the others did not move, and the audit counters bumped once; then
   publishes each moved id after the commit. Chunks are paced by :func:`pace_chunk` so that
   no one-second window moves more than the rate. A publish failure is counted, not fatal:
   the row is pending and the sweeper publishes it after ``publish_grace``.

   Why chunks: one transaction per delivery (a payload check, the move and the counter,
   each a round trip, then a commit) made 100,000 dead letters a 17-minute replay (99/s);
   a chunk pays those once (bench/results_replays.txt).

Two replays racing for one delivery both plan it; the guarded UPDATE lets exactly one move it
and the other records a skip.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from core.clock import Clock, pinned
from core.errors import WebhooksError
from core.logs import get_logger
from core.messages import Dispatch
from core.settings import Settings
from core.states import REPLAYABLE, DeliveryStatus, ReplayStatus
from models import queries, replay_rates, requeue
from models.candidates import (
    Candidate,
    ReplayFilter,
    candidates_by_filter,
    candidates_by_ids,
)
from models.schema import Replay

log = get_logger("replays")

# Defined in models.replay_rates, which the CLI's `replay --rate` option reads without SQLAlchemy.
DEFAULT_RATE = replay_rates.DEFAULT_RATE
MAX_RATE = replay_rates.MAX_RATE

# The most deliveries one chunk moves (one transaction); smaller at low rates, so that a
# chunk is about a tenth of a second's worth and the pacing stays even.
MAX_CHUNK = 500
MAX_PLAN = 100_000  # candidates in one replay; narrow the filter beyond that
SAMPLE_SIZE = 10

Via = Literal["cli", "api", "console"]
# Publishes a chunk's moved deliveries (in messages of several ids: a worker's cost is per
# message) -> all published? (tasks.publisher.CeleryPublisher)
Publish = Callable[[Sequence[Dispatch]], bool]


class ReplayError(WebhooksError, ValueError):
    """The replay was refused or is malformed; nothing was changed."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ReplayRequest:
    operator: str
    reason: str
    via: Via
    filter_as_given: dict[str, Any]  # stored verbatim in the audit row
    ids: tuple[int, ...] = ()
    flt: ReplayFilter | None = None
    rerun_succeeded: bool = False
    rate: float = DEFAULT_RATE


def validate_request(req: ReplayRequest) -> None:
    if not req.reason.strip():
        raise ReplayError(
            "a reason is required (--reason): it goes into the audit record", "no_reason"
        )
    if not req.operator.strip():
        raise ReplayError("an operator name is required (--as)", "no_operator")
    if not 0 < req.rate <= MAX_RATE:
        raise ReplayError(f"rate must be above 0 and at most {MAX_RATE:g} per second", "bad_rate")
    if bool(req.ids) == (req.flt is not None):
        raise ReplayError(
            "give delivery ids or a filter (--source/--type/...), not both", "bad_target"
        )


@dataclass(frozen=True)
class Plan:
    request: ReplayRequest
    candidates: tuple[Candidate, ...]

    @property
    def count(self) -> int:
        return len(self.candidates)

    @property
    def sample(self) -> tuple[Candidate, ...]:
        return self.candidates[:SAMPLE_SIZE]

    @property
    def without_payload(self) -> int:
        """Candidates whose payload retention already dropped: they will be skipped."""
        return sum(1 for c in self.candidates if not c.has_payload)

    @property
    def by_status(self) -> dict[str, int]:
        return dict(Counter(c.status for c in self.candidates))


def _refuse_states(candidates: list[Candidate], rerun_succeeded: bool) -> None:
    succeeded = [c.delivery_id for c in candidates if c.status == DeliveryStatus.SUCCEEDED]
    if succeeded and not rerun_succeeded:
        raise ReplayError(
            f"refused: delivery {_ids(succeeded)} already succeeded. A plain replay would run "
            "its effect again under the same downstream idempotency key; to run it again "
            "deliberately, with a new key, pass --rerun-succeeded (audited like any replay)",
            "succeeded",
        )
    # A filtered delivery (its route's filter did not match) or a superseded one (a newer
    # event of its lane had succeeded) runs only when named by its id: a filter-based replay
    # never selects it (candidates_by_filter takes dead or succeeded).
    # So does a delivery a quarantined route holds for drift (retrying, DriftHeld): the
    # operator decides it runs on the shape it has (docs/drift.md); its replay's attempt is
    # not held again.
    named_only = (DeliveryStatus.FILTERED, DeliveryStatus.SUPERSEDED)
    busy = [
        c for c in candidates if c.status not in (*REPLAYABLE, *named_only) and not c.held_for_drift
    ]
    if busy:
        listed = ", ".join(f"{c.delivery_id} ({c.status})" for c in busy[:10])
        raise ReplayError(
            f"refused: delivery {listed} is still being worked on; only dead, filtered, "
            "superseded or held-for-drift deliveries (or succeeded ones, with "
            "--rerun-succeeded) can be replayed",
            "not_replayable",
        )


def _ids(ids: list[int]) -> str:
    shown = ", ".join(str(i) for i in ids[:10])
    return shown + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")


def plan_replay(session: Session, req: ReplayRequest) -> Plan:
    """Select and freeze the candidates. Read-only."""
    validate_request(req)
    if req.ids:
        found = candidates_by_ids(session, req.ids)
        _refuse_states(found, req.rerun_succeeded)
    else:
        assert req.flt is not None
        if req.flt.status == DeliveryStatus.SUCCEEDED and not req.rerun_succeeded:
            raise ReplayError(
                "refused: replaying succeeded deliveries would run their effects again under "
                "the same downstream idempotency key; pass --rerun-succeeded to run them again "
                "with a new key (audited)",
                "succeeded",
            )
        found = candidates_by_filter(session, req.flt, limit=MAX_PLAN + 1)
    if len(found) > MAX_PLAN:
        raise ReplayError(
            f"more than {MAX_PLAN} deliveries match; narrow the filter (--since/--until/--type)",
            "too_many",
        )
    return Plan(req, tuple(found))


# Pacing --------------------------------------------------------------------------------------


def pace(last_slot: float | None, now: float, rate: float) -> tuple[float, float]:
    """Even pacing (a token bucket holding one token): ``(wait, slot)``.

    ``last_slot`` is when the previous replay ran (seconds on any monotonic scale), ``now`` the
    current time on that scale. The next replay runs ``1 / rate`` after the previous one at the
    earliest, so no window of one second ever holds more than ``rate`` replays.
    """
    if last_slot is None:
        return 0.0, now
    slot = max(now, last_slot + 1.0 / rate)
    return slot - now, slot


def chunk_size(rate: float) -> int:
    """Deliveries per chunk at ``rate``: a tenth of a second's worth, 1 to :data:`MAX_CHUNK`."""
    return max(1, min(MAX_CHUNK, int(rate / 10)))


@dataclass
class Window:
    """The chunks moved in the last second: (when, how many), on the clock's scale, and
    when the last one ran."""

    moved: deque[tuple[float, int]] = field(default_factory=deque)
    last: float | None = None


def pace_chunk(window: Window, now: float, rate: float, want: int) -> tuple[float, int]:
    """``(wait, n)``: after waiting ``wait`` seconds, move the next ``n`` (at most ``want``)
    deliveries in one chunk. A delivery never moves before the slot :func:`pace` would give
    it alone (``1 / rate`` after the previous one's), so a chunk waits for its last one's
    slot; and the chunks of any one-second window hold at most ``rate`` deliveries (at least
    one: below 1/s, one per ``1 / rate``). Record each chunk with :func:`moved`."""
    n = want
    first = now if window.last is None else max(now, window.last + 1.0 / rate)
    gone = -math.inf  # chunks at or before this are out of the window (float-safe)
    while True:
        at = first + (n - 1) / rate
        recent = [(t, k) for t, k in window.moved if t > max(at - 1.0, gone)]
        room = max(1, int(rate)) - sum(k for _, k in recent)
        if room >= n:
            return at - now, n
        if room > 0:
            n = room
        else:  # wait until the oldest chunk in the window leaves it
            gone = recent[0][0]
            first = max(first, gone + 1.0)


def moved(window: Window, at: float, n: int) -> None:
    """A chunk of ``n`` moved at ``at`` (when it really ran)."""
    window.moved.append((at, n))
    while window.moved and window.moved[0][0] <= at - 1.0:
        window.moved.popleft()
    window.last = at


# Execution -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Skip:
    delivery_id: int
    reason: str


@dataclass
class ReplayResult:
    replay_id: int
    planned: int
    replayed: int = 0
    skipped: int = 0
    publish_failed: int = 0  # moved to pending but not published: the sweeper will
    skips: list[Skip] = field(default_factory=list)
    status: ReplayStatus = ReplayStatus.RUNNING

    @property
    def done(self) -> int:
        return self.replayed + self.skipped


def start_replay(sessions: sessionmaker[Session], plan: Plan, *, now: datetime) -> int:
    """Write the audit row; returns its id."""
    req = plan.request
    with sessions() as session, session.begin():
        row = Replay(
            operator=req.operator.strip(),
            reason=req.reason.strip(),
            filter=req.filter_as_given,
            rerun_succeeded=req.rerun_succeeded,
            rate=req.rate,
            status=ReplayStatus.RUNNING,
            planned=plan.count,
            started_at=now,
            via=req.via,
        )
        session.add(row)
        session.flush()
        replay_id = int(row.id)
    log.info(
        "replay.started",
        replay_id=replay_id,
        operator=req.operator,
        via=req.via,
        planned=plan.count,
    )
    return replay_id


# Why the deliveries of a chunk that did not move were skipped: their state now and whether
# their receipt still holds the payload.
_WHY_NOT = text(
    """
    SELECT d.id, d.status, r.payload IS NOT NULL, r.payload_dropped_at
    FROM deliveries d
    LEFT JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at
    WHERE d.id = ANY(:ids)
    """
)


def _skip_reason(c: Candidate, found: tuple[str, bool, datetime | None] | None) -> str:
    status, present, dropped_at = found if found is not None else (None, False, None)
    if not present:
        when = f" on {dropped_at:%Y-%m-%d %H:%M}Z" if dropped_at else ""
        return f"payload dropped by retention{when}: nothing left to deliver"
    if c.held_for_drift:
        return (
            f"now {status}, no longer held for drift: accepted, or claimed for its recheck "
            "first (replay it again if it is held again)"
        )
    return f"now {status}, no longer {c.status}: another replay or the pipeline moved it first"


def _replay_chunk(
    session: Session,
    chunk: Sequence[Candidate],
    replay_id: int,
    *,
    now: datetime | None,
    settings: Settings,
) -> list[Skip]:
    """One chunk in one transaction: the guarded moves, why the others did not move, the
    audit counters. Returns the skips (every other candidate moved)."""
    done = requeue.replay_many(
        session,
        [(c.delivery_id, c.status) for c in chunk],
        now=now,
        publish_grace=settings.publish_grace,
    )
    left = [c for c in chunk if c.delivery_id not in done]
    found: dict[int, tuple[str, bool, datetime | None]] = {}
    if left:
        rows = session.execute(_WHY_NOT, {"ids": [c.delivery_id for c in left]})
        found = {int(r[0]): (r[1], bool(r[2]), r[3]) for r in rows}
    session.execute(
        update(Replay)
        .where(Replay.id == replay_id)
        .values(replayed=Replay.replayed + len(done), skipped=Replay.skipped + len(left))
    )
    return [Skip(c.delivery_id, _skip_reason(c, found.get(c.delivery_id))) for c in left]


def _finish(
    sessions: sessionmaker[Session], replay_id: int, status: ReplayStatus, now: datetime
) -> None:
    with sessions() as session, session.begin():
        session.execute(
            update(Replay).where(Replay.id == replay_id).values(status=status, ended_at=now)
        )


def execute(
    sessions: sessionmaker[Session],
    plan: Plan,
    replay_id: int,
    *,
    settings: Settings,
    clock: Clock,
    sleep: Callable[[float], None],
    publish: Publish,
    on_progress: Callable[[ReplayResult], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> ReplayResult:
    """Run the plan at ``plan.request.rate`` per second; always closes the audit row.

    ``cancelled`` (the console's Cancel) is asked before each chunk: once it says so, the run
    stops there with status ``cancelled``; what it moved stays moved, the rest stays dead.

    Interrupted (Ctrl-C) or failed runs keep what they did (each chunk commits whole): the
    audit row says so, and the deliveries not reached are still dead, so running the same
    filter again picks them up.
    """
    result = ReplayResult(replay_id, plan.count)
    rate = plan.request.rate
    size = chunk_size(rate)
    window = Window()
    todo = list(plan.candidates)
    try:
        while todo:
            if cancelled is not None and cancelled():
                result.status = ReplayStatus.CANCELLED
                break
            wait, n = pace_chunk(window, clock.now().timestamp(), rate, min(size, len(todo)))
            if wait > 0:
                sleep(wait)
            chunk, todo = todo[:n], todo[n:]
            now = clock.now()
            # Paced from when this chunk really ran: an overslept wait never shortens the next.
            moved(window, now.timestamp(), n)
            with sessions() as session, session.begin():
                # Their due time on the database's clock (unless a test pinned one).
                skips = _replay_chunk(
                    session, chunk, replay_id, now=pinned(clock), settings=settings
                )
            skipped = {s.delivery_id for s in skips}
            moved_now = [
                Dispatch(c.delivery_id, c.event_id, c.source)
                for c in chunk
                if c.delivery_id not in skipped
            ]
            result.replayed += len(moved_now)
            if moved_now and not publish(moved_now):
                result.publish_failed += len(moved_now)
            result.skipped += len(skips)
            result.skips += skips
            if on_progress is not None:
                on_progress(result)
        else:
            result.status = ReplayStatus.DONE
    except KeyboardInterrupt:
        result.status = ReplayStatus.INTERRUPTED
        raise
    except BaseException:
        result.status = ReplayStatus.FAILED
        raise
    finally:
        try:
            _finish(sessions, replay_id, result.status, clock.now())
        finally:
            log.info(
                "replay.finished",
                replay_id=replay_id,
                status=result.status,
                planned=result.planned,
                replayed=result.replayed,
                skipped=result.skipped,
                publish_failed=result.publish_failed,
            )
    return result


@dataclass(frozen=True)
class ReplayRecord:
    """The audit row as operators read it."""

    id: int
    operator: str
    reason: str
    filter: dict[str, Any]
    rerun_succeeded: bool
    rate: float | None
    status: str
    planned: int
    replayed: int
    skipped: int
    started_at: datetime
    ended_at: datetime | None
    via: str


def _record(row: Replay) -> ReplayRecord:
    return ReplayRecord(
        row.id,
        row.operator,
        row.reason,
        row.filter,
        row.rerun_succeeded,
        row.rate,
        row.status,
        row.planned,
        row.replayed,
        row.skipped,
        row.started_at,
        row.ended_at,
        row.via,
    )


def get_replay(session: Session, replay_id: int) -> ReplayRecord:
    row = session.get(Replay, replay_id)
    if row is None:
        raise queries.NotFoundError(f"no such replay: {replay_id}")
    return _record(row)


def list_replays(session: Session, *, limit: int = 20) -> list[ReplayRecord]:
    rows = session.scalars(select(Replay).order_by(Replay.id.desc()).limit(limit))
    return [_record(r) for r in rows]
