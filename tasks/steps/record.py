"""Steps 4 and 5 of a message: each attempt's outcome committed, then its after-hooks.

4. the successes of handlers that wrote nothing through ``ctx.session``: one guarded
   statement per partition (:func:`models.deliveries.succeed`), one synchronous commit, then
   the fast claims promoted to the source's dedup TTL in one round trip (:func:`finish`);
5. each caught failure on its own (:func:`fail`): ``retry_later`` (full-jitter backoff) or
   ``kill`` committed, the Redis key released, and only then the retry scheduled with
   admission (or a countdown message; longer delays are the sweeper's), so the message never
   arrives before the state that allows it to be claimed.

Once a handler has returned, its outcome is recorded through database faults for
``WEBHOOKS_RECORD_RETRY_SECONDS`` (:func:`tasks.connections.record`): a failed commit is
never a reason to call the downstream again; past that the lease hands the delivery on
("unrecorded"). After each committed outcome the :data:`HOOKS` run, in the style of dramatiq's
middleware: the route circuit breaker counts it there (:class:`BreakerHook`, whose statements
are :mod:`models.breaker`).
"""

from __future__ import annotations

import dataclasses
import enum
import traceback
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy.orm import Session

from core.clock import pinned
from core.logs import get_logger
from core.messages import Dispatch
from core.metrics import (
    ADMISSIONS,
    BREAKER_CHANGES,
    BREAKER_STATE,
    DEAD_LETTERS,
    DELIVERIES,
    RECEIPT_TO_SUCCESS,
    REPEAT_WINDOWS,
    RETRIES,
    TRANSFORM_DROPPED,
)
from core.states import DeadReason
from models import breaker, deliveries, transitions
from models.admission import Admission
from models.breaker import BreakerChange, Thresholds
from models.transitions import Claim, ClaimedEvent, IllegalTransition
from tasks.claims import FastClaim
from tasks.connections import CONNECTION_ERRORS, Unrecorded, on_connection, record
from tasks.errors import (
    DownstreamError,
    DriftHeld,
    HandlerError,
    LeaseFenced,
    PermanentError,
    RetryableError,
)
from tasks.policy import DEAD_EXPIRED, DEAD_MAX_AGE, RetryPolicy, decide
from tasks.runtime import Runtime
from tasks.steps.claim import Claimed
from tasks.steps.inputs import Loaded
from tasks.steps.outcome import Outcome, PublishRetry, Report, scope, source_label
from tasks.transforms import TransformDropped, TransformFailed

log = get_logger(__name__)


class RetryVia(enum.StrEnum):
    """Who publishes a retry's next copy: the ``via`` of ``delivery.retry``."""

    ADMISSION = "admission"  # the dispatcher, once due, within the route's limits
    COUNTDOWN = "countdown"  # a countdown message of its own
    SWEEPER = "sweeper"  # the sweeper, once due (a long delay, or both others failed)


@dataclass(frozen=True)
class Done:
    """A handler that returned without writing through ``ctx.session``: its success is still
    to be recorded, with the message's others of its partition in one statement (step 4)."""

    claimed: Claimed
    loaded: Loaded
    at: datetime
    result_ref: str | None = None  # what the handler returned to be stored (tasks.context)


def describe_error(exc: BaseException) -> str:
    """An error message fit for storage and logs: our typed errors carry payload-free
    messages by contract; for anything else only the class and where it was raised (its
    message may quote the payload)."""
    if isinstance(exc, HandlerError):
        return f"{exc.reason}: {exc}"[:500]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    where = "/".join(Path(last.filename).parts[-2:])
    return f"{type(exc).__name__} raised at {where}:{last.lineno} in {last.name}"


# -- the after-hooks ------------------------------------------------------------------------


class Hook:
    """Runs after an attempt's outcome is committed (dramatiq's ``after_process_message``).
    A hook never fails the attempt: that outcome is committed already."""

    def after_success(self, rt: Runtime, found: Claim, row: ClaimedEvent) -> None:
        """A committed success."""

    def after_failure(self, rt: Runtime, found: Claim, exc: BaseException) -> None:
        """A committed failed attempt (retry later, or dead)."""


class BreakerHook(Hook):
    """The worker's side of the route circuit breaker (:mod:`models.breaker`): count a
    finished attempt, and log and count every state change. A breaker statement that fails
    (the database went away) is logged and skipped; the breaker learns from the next
    attempt."""

    def after_success(self, rt: Runtime, found: Claim, row: ClaimedEvent) -> None:
        """Closes a half-open route, counts a request in an open failure window; nothing at
        all on a healthy route."""
        if row.breaker_state == breaker.CLOSED and not row.window_failures:
            return
        try:
            change = on_connection(
                rt.engine,
                lambda raw: breaker.record_success(
                    raw,
                    found.route_id,
                    Thresholds.of(rt.settings),
                    state=row.breaker_state,
                    window_failures=row.window_failures,
                    now=pinned(rt.clock),
                ),
            )
        except Exception as exc:  # noqa: BLE001 (the success is committed: the class docstring)
            _not_counted(found, exc)
            return
        _note_change(change, via="success")

    def after_failure(self, rt: Runtime, found: Claim, exc: BaseException) -> None:
        """A downstream failure counts; anything else (a permanent 4xx, a handler's own
        error) never does."""
        if not isinstance(exc, DownstreamError):
            return
        try:
            change = on_connection(
                rt.engine,
                lambda raw: breaker.record_failure(
                    raw, found.route_id, Thresholds.of(rt.settings), now=pinned(rt.clock)
                ),
            )
        except Exception as err:  # noqa: BLE001 (the failure is committed: the class docstring)
            _not_counted(found, err)
            return
        _note_change(change, via="failure")


def _not_counted(found: Claim, exc: BaseException) -> None:
    log.warning(
        "route.breaker_not_counted", route_id=found.route_id, error_class=type(exc).__name__
    )


def _note_change(change: BreakerChange | None, *, via: str) -> None:
    """One structured line (``route.breaker_opened`` / ``_closed``), the change counter and
    the state gauge, for a change that changed something."""
    if change is None or not change.changed:
        return
    route = str(change.route_id)
    BREAKER_CHANGES.labels(route=route, state=change.after).inc()
    BREAKER_STATE.labels(route=route).set(breaker.STATE_VALUES[change.after])
    event = "route.breaker_opened" if change.after == breaker.OPEN else "route.breaker_closed"
    log.warning(
        event,
        route_id=change.route_id,
        before=change.before,
        after=change.after,
        trips=change.trips,
        via=via,
    )


HOOKS: tuple[Hook, ...] = (BreakerHook(),)

# The reasons of a failed attempt whose call was sent and whose answer never came in time:
# the downstream may have applied it (forward's I/O timeout, the hard time limit).
TIMED_OUT = frozenset({"timeout", "hard_time_limit"})


def timed_out(exc: BaseException) -> bool:
    """A failure that ended a call before its answer came: a time limit, or an I/O timeout."""
    return isinstance(exc, SoftTimeLimitExceeded) or getattr(exc, "reason", None) in TIMED_OUT


# -- step 4: the successes ------------------------------------------------------------------


def finish(rt: Runtime, done: list[Done], publish_retry: PublishRetry) -> list[Report]:
    """The successes still to record, one statement per partition, each retried through
    database faults (:mod:`tasks.connections`): these handlers' effects already happened."""
    if not done:
        return []
    by_leaf: dict[str | None, list[Done]] = defaultdict(list)
    for d in done:
        by_leaf[d.claimed.leaf].append(d)
    reports: list[Report] = []
    confirmed: list[tuple[FastClaim, timedelta]] = []
    for leaf, group in by_leaf.items():
        pairs = [(d.claimed.found, d.at) for d in group]
        refs = [d.result_ref for d in group]
        ids = [found.id for found, _ in pairs]

        def succeed(
            leaf: str | None = leaf,
            pairs: list[tuple[Claim, datetime]] = pairs,
            refs: list[str | None] = refs,
        ) -> set[int]:
            return on_connection(
                rt.engine,
                lambda raw: deliveries.on_leaf(
                    leaf, lambda on: deliveries.succeed(raw, pairs, leaf=on, refs=refs)
                ),
            )

        try:
            won = record(
                rt.engine, "succeed", ids, succeed, within=rt.settings.record_retry_seconds
            )
        except Unrecorded:
            reports += [unrecorded(d.claimed.found, d.claimed.row) for d in group]
            continue
        except Exception as exc:  # noqa: BLE001 (each one's attempt failed, like a handler error)
            reports += [_fail_done(rt, d, exc, publish_retry) for d in group]
            continue
        if len(won) < len(group):  # a lease lost, or a commit retried after its answer was lost
            won |= _recorded(rt, [d.claimed.found for d in group if d.claimed.found.id not in won])
        for d in group:
            if d.claimed.found.id in won:
                reports.append(succeeded(rt, d))
                if d.loaded.dedup_ttl is not None:
                    confirmed.append((d.claimed.fast, d.loaded.dedup_ttl))
            else:
                reports.append(lost(rt, d.claimed.found, d.claimed.fast, d.claimed.row))
    rt.claims.confirm_many(confirmed)
    return reports


def _recorded(rt: Runtime, found: list[Claim]) -> set[int]:
    return record(
        rt.engine,
        "check",
        [f.id for f in found],
        lambda: on_connection(rt.engine, lambda raw: deliveries.recorded(raw, found)),
        within=rt.settings.record_retry_seconds,
    )


def unrecorded(found: Claim, row: ClaimedEvent) -> Report:
    """The outcome could not be recorded within WEBHOOKS_RECORD_RETRY_SECONDS: the delivery
    keeps its lease (and its fast claim, which expires with it) and is taken over once the
    lease runs out, as after a crash."""
    DELIVERIES.labels(outcome=Outcome.UNRECORDED, source=source_label(row)).inc()
    return Report.of(
        Outcome.UNRECORDED,
        found,
        row,
        "the database stayed unreachable: the lease hands the delivery on when it ends",
    )


def _fail_done(rt: Runtime, done: Done, exc: Exception, publish_retry: PublishRetry) -> Report:
    """Recording the success failed (the database went away): a failed attempt, like any."""
    claimed = done.claimed
    with rt.sessions() as session:
        return fail(
            rt,
            session,
            claimed,
            exc=exc,
            policy=done.loaded.policy,
            publish_retry=publish_retry,
            now=claimed.now(rt.clock),
        )


def succeeded(rt: Runtime, done: Done) -> Report:
    """The success is committed: its hooks, then count and log it (:func:`finish` promotes
    the fast claims of the message's successes together)."""
    found, loaded, fast = done.claimed.found, done.loaded, done.claimed.fast
    row = done.claimed.row
    for hook in HOOKS:
        hook.after_success(rt, found, row)
    DELIVERIES.labels(outcome=Outcome.SUCCEEDED, source=source_label(row)).inc()
    RECEIPT_TO_SUCCESS.observe(max(0.0, (done.at - loaded.event.meta.received_at).total_seconds()))
    log.info(
        "delivery.succeeded",
        delivery_id=found.id,
        event_id=loaded.event.event_id,
        handler=loaded.route.handler,
        attempt=found.attempt,
        degraded=fast.degraded,
        **scope(found, row, done.at),
    )
    return Report.of(Outcome.SUCCEEDED, found, row, finished=True)


def lost(rt: Runtime, found: Claim, fast: FastClaim, row: ClaimedEvent) -> Report:
    """Our lease ran out and another attempt took over: our writes were rolled back."""
    rt.claims.release(fast)
    DELIVERIES.labels(outcome=Outcome.LOST, source=source_label(row)).inc()
    log.warning("delivery.lease_lost", delivery_id=found.id, attempt=found.attempt)
    return Report.of(
        Outcome.LOST, found, row, "its lease ran out and another attempt took the delivery over"
    )


# -- step 5: a failure ----------------------------------------------------------------------


def fail(
    rt: Runtime,
    session: Session,
    claimed: Claimed,
    *,
    exc: Exception,
    policy: RetryPolicy,
    publish_retry: PublishRetry,
    now: datetime,
) -> Report:
    """Record a failed attempt (retry later, or dead) on the handler's session, retried on
    fresh ones through lost connections; then release its fast claim, run the hooks, and
    schedule the retry."""
    found, row, fast = claimed.found, claimed.row, claimed.fast
    # A failed probe of a half-open route is the outage going on, not this delivery's
    # budget: never its last attempt, and not counted by the next ones (models/breaker.py).
    # It ages like any attempt: past its max_age it goes dead, ``expired`` (issue 34: an
    # open breaker never keeps a delivery alive past its max_age; models/route_ends.py).
    probe = row.breaker_state == breaker.HALF_OPEN and isinstance(exc, DownstreamError)
    if probe:
        policy = dataclasses.replace(policy, max_attempts=found.attempts_in_run + 1)
    decision = decide(
        policy,
        attempt=found.attempts_in_run,
        started_at=age_from(found, row),
        now=now,
        permanent=isinstance(exc, PermanentError),
        requested_delay=exc.delay if isinstance(exc, RetryableError) else None,
        rng=rt.rng,
    )
    error_class, error = type(exc).__name__, describe_error(exc)
    if isinstance(exc, TransformFailed):  # its dead letter names what the transform raised
        decision = dataclasses.replace(decision, reason=DeadReason.TRANSFORM_FAILED)
        error_class = exc.raised
    if probe and decision.reason == DEAD_MAX_AGE:
        decision = dataclasses.replace(decision, reason=DEAD_EXPIRED)
        error = f"{expired_probe(policy, row, now)}; last error: {error}"

    def transition(on: Session) -> None:
        if decision.retry:
            assert decision.next_attempt_at is not None
            transitions.retry_later(
                on,
                found,
                now=now,
                next_attempt_at=decision.next_attempt_at,
                error_class=error_class,
                error=error,
                uncounted=probe,
            )
        else:
            transitions.kill(
                on, found, now=now, reason=decision.reason, error_class=error_class, error=error
            )

    handler_session = [session]

    def write() -> None:
        # The handler's session first; after a connection error, a fresh one each time.
        if handler_session:
            first = handler_session.pop()
            with first.begin():
                transition(first)
            return
        with rt.sessions() as fresh, fresh.begin():
            transition(fresh)

    action = Outcome.RETRY if decision.retry else Outcome.DEAD
    try:
        record(rt.engine, action, [found.id], write, within=rt.settings.record_retry_seconds)
    except IllegalTransition:
        return lost(rt, found, fast, row)
    except Unrecorded:
        return unrecorded(found, row)
    # The state is committed: now the next copy may come.
    rt.claims.release(fast)
    for hook in HOOKS:
        hook.after_failure(rt, found, exc)
    fields = {
        "delivery_id": found.id,
        "attempt": found.attempt,
        "error_class": error_class,
        "error_reason": getattr(exc, "reason", None),
        **scope(found, row, now),
    }
    source = source_label(row)
    if not decision.retry:
        DEAD_LETTERS.labels(reason=decision.reason, source=source).inc()
        DELIVERIES.labels(outcome=Outcome.DEAD, source=source).inc()
        log.warning("delivery.dead", reason=decision.reason, **fields)
        return Report.of(Outcome.DEAD, found, row, f"{decision.reason}: {error}", finished=True)
    RETRIES.labels(source=source).inc()
    DELIVERIES.labels(outcome=Outcome.RETRY, source=source).inc()
    if timed_out(exc):  # its call may have landed: a named window
        REPEAT_WINDOWS.labels(cause="answer_timeout").inc()
    delay_s = decision.delay.total_seconds()
    via = _next_copy(rt, found, row, delay_s, decision.countdown, publish_retry)
    log.info("delivery.retry", delay_s=delay_s, via=via, **fields)
    return Report.of(
        Outcome.RETRY,
        found,
        row,
        error,
        countdown={RetryVia.COUNTDOWN: decision.countdown, RetryVia.ADMISSION: delay_s}.get(via),
        finished=True,
    )


def _next_copy(
    rt: Runtime,
    found: Claim,
    row: ClaimedEvent,
    delay_s: float,
    countdown: float | None,
    publish_retry: PublishRetry,
) -> RetryVia:
    """Schedule the next copy of a delivery whose retry is committed: with admission, else a
    countdown message (``countdown`` None: too long for one), else the sweeper's."""
    if rt.settings.admission and _schedule(rt, found.id, delay_s):
        return RetryVia.ADMISSION
    if countdown is not None:
        try:
            publish_retry(Dispatch(found.id, row.event_id, row.public_id), countdown)
        except Exception as publish_exc:  # noqa: BLE001 (the sweeper publishes it later)
            log.warning(
                "delivery.retry_publish_failed",
                delivery_id=found.id,
                error_class=type(publish_exc).__name__,
            )
        else:
            return RetryVia.COUNTDOWN
    return RetryVia.SWEEPER


def fenced(
    rt: Runtime,
    session: Session,
    claimed: Claimed,
    exc: LeaseFenced,
    publish_retry: PublishRetry,
) -> Report:
    """The fence refused a call (:meth:`tasks.context.HandlerContext.fence`): nothing was
    sent. If the lease is still this attempt's, it is handed back at once (retrying, due now,
    not counted against ``max_attempts`` and not by the breaker); if another attempt took it
    over, that attempt decides. When the database cannot be reached the lease is left to run
    out, as after a crash. Never a failed attempt: a worker's own pause is no reason to spend a
    delivery's attempts."""
    found, row, fast = claimed.found, claimed.row, claimed.fast
    now = claimed.now(rt.clock)
    handed_back = False
    try:
        with session.begin():
            transitions.retry_later(
                session,
                found,
                now=now,
                next_attempt_at=now,
                error_class=type(exc).__name__,
                error=str(exc),
                uncounted=True,
            )
        handed_back = True
    except IllegalTransition:
        pass  # taken over: its holder decides
    except CONNECTION_ERRORS as err:
        log.warning(
            "delivery.fence_unrecorded", delivery_id=found.id, error_class=type(err).__name__
        )
    rt.claims.release(fast)
    DELIVERIES.labels(outcome=Outcome.FENCED, source=source_label(row)).inc()
    log.warning(
        "delivery.fenced",
        delivery_id=found.id,
        attempt=found.attempt,
        lease_left_s=round(exc.left, 3),
        needed_s=exc.needed,
        handed_back=handed_back,
    )
    if handed_back:
        _next_copy(rt, found, row, 0.0, 0.0, publish_retry)
    return Report.of(Outcome.FENCED, found, row, str(exc), finished=handed_back)


def dropped(rt: Runtime, claimed: Claimed, loaded: Loaded, exc: TransformDropped) -> Report:
    """The route's transform returned None: the delivery ends ``filtered`` (its reason names
    the transform), counted per route; its fast claim kept for the dedup TTL, as a success's
    is. A lost lease: another attempt decides."""
    found, row, fast = claimed.found, claimed.row, claimed.fast
    now = claimed.now(rt.clock)
    reason = f"route {found.route_id}: transform {exc.name} dropped the event"

    def write() -> None:
        with rt.sessions() as fresh, fresh.begin():
            transitions.filter_out(fresh, found, now=now, reason=reason)

    try:
        record(
            rt.engine, Outcome.FILTERED, [found.id], write, within=rt.settings.record_retry_seconds
        )
    except IllegalTransition:
        return lost(rt, found, fast, row)
    except Unrecorded:
        return unrecorded(found, row)
    if loaded.dedup_ttl is not None:
        rt.claims.confirm(fast, loaded.dedup_ttl)
    else:
        rt.claims.release(fast)
    source = source_label(row)
    TRANSFORM_DROPPED.labels(source=source, route=str(found.route_id)).inc()
    DELIVERIES.labels(outcome=Outcome.FILTERED, source=source).inc()
    log.info(
        "delivery.filtered",
        delivery_id=found.id,
        attempt=found.attempt,
        transform=exc.name,
        **scope(found, row, now),
    )
    return Report.of(Outcome.FILTERED, found, row, reason, finished=True)


def held_for_drift(rt: Runtime, session: Session, claimed: Claimed, exc: DriftHeld) -> Report:
    """A quarantined route's delivery whose event drifted (tasks/steps/run.py): no call was
    made; the lease is handed back as retrying, due after the hold's recheck
    (models/drift.py HOLD_RECHECK), its error class ``DriftHeld``, spending no attempt.
    ``webhooks drift accept`` makes it due at once. If another attempt took the lease over,
    that attempt decides."""
    from models import drift  # noqa: PLC0415 (only a quarantined route's drifted event)

    found, row, fast = claimed.found, claimed.row, claimed.fast
    now = claimed.now(rt.clock)
    held_now = False
    try:
        with session.begin():
            transitions.retry_later(
                session,
                found,
                now=now,
                next_attempt_at=now + drift.HOLD_RECHECK,
                error_class=drift.HELD_CLASS,
                error=f"held: drift ({exc})",
                uncounted=True,
            )
        held_now = True
    except IllegalTransition:
        pass  # taken over: its holder decides
    rt.claims.release(fast)
    DELIVERIES.labels(outcome=Outcome.HELD, source=source_label(row)).inc()
    log.warning("delivery.held_drift", delivery_id=found.id, why=str(exc), held=held_now)
    return Report.of(Outcome.HELD, found, row, f"held: drift ({exc})", finished=held_now)


def age_from(found: Claim, row: ClaimedEvent) -> datetime:
    """Where a delivery's max_age counts from: its first attempt (or creation), but never
    before its route's last resume by hand (``released_at``): a pause is an operator's
    decision, and the time it held the route does not age its work (issue 23 item 4). An
    open breaker is not: its time counts, and a failed probe ages like any attempt, so no
    breaker keeps a delivery alive past its max_age (issue 34; models/route_ends.py)."""
    start = found.first_attempt_at or found.created_at
    return start if row.released_at is None else max(start, row.released_at)


def expired_probe(policy: RetryPolicy, row: ClaimedEvent, now: datetime) -> str:
    """What the dead letter of a probe failed past its max_age says: how long its route's
    breaker had been open (as the sweep's ``expired`` letters say, models/route_ends.py)."""
    text = (
        f"expired: its max_age ({int(policy.max_age.total_seconds())} s) passed while its "
        "route's breaker was open;"
    )
    opened = row.breaker_opened_at
    if opened is not None:
        since = opened.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        text += (
            f" the breaker had been open for {int((now - opened).total_seconds())} s "
            f"(since {since})"
        )
    return text


def _schedule(rt: Runtime, delivery_id: int, delay_s: float) -> bool:
    """The retry waits for admission (models/admission.py, ``adm:d``): the dispatcher admits
    it once due, within its route's in-flight budget and rate limit, instead of a countdown
    message that would reach the downstream around both. False when Redis fails: the
    countdown then (admission fails open, as everywhere)."""
    try:
        Admission(rt.redis).schedule(delivery_id, delay_s)
    except Exception as exc:  # noqa: BLE001 (fail open: the caller publishes the countdown)
        ADMISSIONS.labels("failed_open").inc()
        log.warning(
            "delivery.retry_schedule_failed",
            delivery_id=delivery_id,
            error_class=type(exc).__name__,
        )
        return False
    ADMISSIONS.labels("scheduled").inc()
    return True
