"""The ``webhooks.deliver`` Celery task: the entry point of a message of deliveries.

A message carries one delivery id, or a list of them (:func:`message_ids`). Either way the task
hands them to :func:`tasks.pipeline.run`, which owns the claim, the handlers and the recording
of their outcomes for n >= 1 deliveries (a message of one id is a batch of one, through the
same code; docs/workers.md argues why each effect happens once). What stays here is
Celery's side: the task's state (what Flower shows: :func:`celery_state` for one id,
:func:`celery_batch_state` for a list), the retry messages it publishes, and the admission
slots it frees as soon as it ends (:func:`release_slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery, Task
from celery.exceptions import Retry

from core import tracing
from core.clock import pinned
from core.errors import WebhooksError
from core.logs import get_logger
from core.messages import DELIVER_TASK, TRACE_HEADER, Dispatch, batches, message
from core.settings import MAX_DELIVERY_BATCH
from models import lanes
from models.admission import Admission
from models.db import DatabaseUnavailable
from tasks import dispatcher
from tasks.connections import CONNECTION_ERRORS, on_connection
from tasks.pause import request_pause
from tasks.pipeline import run
from tasks.runtime import Runtime
from tasks.steps.outcome import Outcome, Report

log = get_logger(__name__)


class DeadLetter(WebhooksError):
    """Raised by the task once the dead state is committed, so that Celery (and Flower)
    shows the attempt as FAILURE with the reason. Declared in the task's ``throws``: an
    expected outcome, logged without a traceback; the message is acknowledged all the same
    (a failed task is acked), so nothing redelivers it."""


class AttemptFailed(WebhooksError):
    """The error of an attempt that will be retried: the exception of its RETRY state."""


def celery_state(report: Report) -> str:
    """Turn a run's report into the task's Celery state: RETRY (with the error) for an
    attempt that will be retried, FAILURE (with the reason) for a dead letter, SUCCESS
    otherwise, with a result that says what happened, so a duplicate or skipped copy is
    never mistaken for a real success."""
    where = f"delivery {report.delivery_id} attempt {report.attempt}"
    if report.outcome == Outcome.RETRY:
        then = (
            f"next copy in {report.countdown:.1f}s"
            if report.countdown is not None
            else "the sweeper publishes the next copy when it is due"
        )
        raise Retry(
            f"{where} failed, will retry: {report.detail}; {then}",
            exc=AttemptFailed(f"{where}: {report.detail}"),
        )
    if report.outcome == Outcome.DEAD:
        raise DeadLetter(f"{where}: dead letter ({report.detail})")
    if report.outcome == Outcome.SUCCEEDED:
        return Outcome.SUCCEEDED.value
    if report.outcome == Outcome.LOST:
        return f"lost: {report.detail}"
    if report.outcome in (Outcome.UNRECORDED, Outcome.FENCED):
        return f"{report.outcome}: {report.detail}"
    return {
        Outcome.DUPLICATE: "duplicate: another copy holds or completed this delivery",
        Outcome.SKIPPED: "skipped: done, dead, not due yet or owned by a live lease",
        Outcome.HELD: "held: its route is paused or its circuit breaker is open (not an attempt)",
        Outcome.MISSING: "missing: no such delivery",
        Outcome.ISOLATED: "isolated: its worker died holding it; published again alone",
        Outcome.LANE: "lane: an earlier delivery of its lane is unfinished (not an attempt)",
        Outcome.SUPERSEDED: f"superseded: {report.detail}",
    }.get(report.outcome, str(report.outcome))


def celery_batch_state(reports: list[Report]) -> str:
    """A message of several deliveries: its Celery state is its worst delivery's (FAILURE if
    one went dead, RETRY if one will be retried, SUCCESS otherwise), and its text, what
    Flower shows, names every delivery it carried with its own outcome."""
    lines = [
        f"{r.delivery_id}: {r.outcome}: {r.detail}"[:300]
        if r.outcome in (Outcome.RETRY, Outcome.DEAD)
        else f"{r.delivery_id}: {celery_state(r)}"
        for r in reports
    ]
    counts: dict[str, int] = {}
    for report in reports:
        counts[report.outcome] = counts.get(report.outcome, 0) + 1
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    text = f"{len(reports)} deliveries ({summary}): " + "; ".join(lines)
    if counts.get(Outcome.DEAD):
        raise DeadLetter(text)
    if counts.get(Outcome.RETRY):
        raise Retry(text, exc=AttemptFailed(text))
    return text


def message_ids(argument: object) -> list[int] | None:
    """The delivery ids a message carries: one id, or a non-empty list of at most
    ``MAX_DELIVERY_BATCH``; None for anything else."""
    values = argument if isinstance(argument, list) else [argument]
    if not 0 < len(values) <= MAX_DELIVERY_BATCH:
        return None
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return ids if len(ids) == len(values) else None


def register(app: Celery, runtime: Callable[[], Runtime]) -> Task[Any, Any]:
    """The ``webhooks.deliver`` task on ``app``, with this process's runtime (built by the
    worker on first use: :class:`tasks.worker.WorkerProcess`)."""

    @app.task(bind=True, name=DELIVER_TASK, ignore_result=True, throws=(DeadLetter,))
    def deliver(self: Task[Any, Any], delivery_id: int | list[int]) -> str:
        return deliver_message(self, runtime, delivery_id)

    return deliver


def deliver_message(
    task: Task[Any, Any], runtime: Callable[[], Runtime], delivery_id: int | list[int]
) -> str:
    """Celery entry point: one delivery id, or a list of them; both through
    :func:`tasks.pipeline.run`."""
    ids = message_ids(delivery_id)
    if ids is None:
        log.error("delivery.bad_message", error_class=type(delivery_id).__name__)
        return "rejected: not a delivery id or a list of them"

    def publish_retry(dispatch: Dispatch, countdown: float) -> None:
        options: dict[str, Any] = {"countdown": countdown, **dispatch.reprs()}
        task.apply_async(args=(dispatch.delivery_id,), **options)

    alone = not isinstance(delivery_id, list)
    try:
        rt = runtime()  # a worker started during an outage builds it on its first task
        traces = message_traces(task) if tracing.STATE.on else None
        reports = run(rt, ids, publish_retry=publish_retry, alone=alone, traces=traces)
    except CONNECTION_ERRORS as exc:
        # A handled condition (a lost connection, a restarted database, a host cut off from
        # it): one line, never a traceback. The message goes back to the broker for another
        # worker, and this worker pauses until its database answers (tasks.pause), instead of
        # taking its share of the queue into the same failure.
        reason = type(exc).__name__
        log.warning("delivery.database_unavailable", delivery_ids=ids, error_class=reason)
        request_pause(task.app, task.request.hostname, reason)
        then = (
            "requeued for another worker; this one pauses until its database answers"
            if requeue(task, delivery_id)
            else "the sweeper republishes them"
        )
        text = f"deliveries {ids}: database unavailable ({reason}); {then}"
        raise Retry(text, exc=DatabaseUnavailable(text)) from None

    def publish_group(group: Sequence[Dispatch]) -> None:
        args, options = message(group, rt.settings)
        task.apply_async(args=args, **options)

    handed = lane_heads(rt, reports, publish_group)
    release_slots(rt, [r for r in reports if r.delivery_id not in handed])
    return celery_state(reports[0]) if alone else celery_batch_state(reports)


def message_traces(task: Task[Any, Any]) -> dict[str, str]:
    """The traceparent of each delivery id the message's header names (core/tracing.py);
    empty when it names none or something else."""
    request = task.request
    found = getattr(request, TRACE_HEADER, None)
    if found is None:
        found = (getattr(request, "headers", None) or {}).get(TRACE_HEADER)
    if not isinstance(found, dict):
        return {}
    return {str(k): v for k, v in found.items() if isinstance(v, str)}


def requeue(task: Task[Any, Any], argument: int | list[int]) -> bool:
    """Publish a copy of this task's message (its argument, what Flower shows of it, its time
    limits) for another worker to take now; the original is then acknowledged. False, logged,
    when the broker refuses it too: the sweeper's pick brings the deliveries back."""
    request = task.request
    options: dict[str, Any] = {
        name: value
        for name in ("argsrepr", "kwargsrepr")
        if (value := getattr(request, name, None)) is not None
    }
    hard, soft = request.timelimit or (None, None)
    if hard:
        options["time_limit"] = hard
    if soft:
        options["soft_time_limit"] = soft
    try:
        task.apply_async(args=(argument,), **options)
    except Exception as exc:  # noqa: BLE001 (the sweeper is the fallback, as before)
        log.warning("delivery.requeue_failed", error_class=type(exc).__name__)
        return False
    return True


#: Outcomes after which a lane's next delivery may run: the delivery ended (filtered by its
#: transform too; dead: it no longer holds a ``skip`` lane), or its lane refused it (the lane
#: may have opened since).
LANE_MOVES = (Outcome.SUCCEEDED, Outcome.DEAD, Outcome.SUPERSEDED, Outcome.FILTERED, Outcome.LANE)


def lane_heads(
    rt: Runtime, reports: list[Report], publish: Callable[[Sequence[Dispatch]], None]
) -> set[int]:
    """Publish the claimable head of each lane a delivery of this message ended in, or was
    refused by (models/lanes.py): an ordered route drains at the pace of its handlers, not
    of the sweeper. After the outcomes' commits, so the head read here is the one that may
    run. Published directly, in messages of up to WEBHOOKS_DELIVERY_BATCH ids as the sweeper
    does, one head per lane that moved, each in the admission slot its predecessor leaves
    (:meth:`models.admission.Admission.hand_over`: the route's in-flight count stays true
    and within its budget, and the head waits for no dispatch round). Before the slots of
    this message are released (:func:`release_slots`), which is what makes the hand-over
    possible; returns the deliveries whose slots the hand-over freed, which that release
    skips (a refused head published again holds its own id's slot). A head published twice
    is claimed once. Failing here loses nothing: the sweeper picks lane heads, and the
    slots not handed over are released as usual."""
    moved = [r for r in reports if r.lane is not None and r.outcome in LANE_MOVES]
    if not moved:
        return set()
    try:
        heads = on_connection(
            rt.engine,
            lambda raw: lanes.next_heads(
                raw, [r.lane for r in moved if r.lane is not None], now=pinned(rt.clock)
            ),
        )
    except Exception as exc:  # noqa: BLE001 (the sweeper publishes lane heads too)
        log.warning("delivery.lane_publish_failed", error_class=type(exc).__name__)
        return set()
    freed, counted = hand_over(rt, moved, heads)
    ready = [Dispatch(h.delivery_id, h.event_id, h.source) for h in heads]
    for group in batches(ready, rt.settings.deliveries_per_message):
        try:
            publish(group)
        except Exception as exc:  # noqa: BLE001 (the sweeper publishes lane heads too)
            log.warning("delivery.lane_publish_failed", error_class=type(exc).__name__)
            unpublished(
                rt,
                {d.delivery_id: counted[d.delivery_id] for d in group if d.delivery_id in counted},
            )
    return freed


def hand_over(
    rt: Runtime, moved: list[Report], heads: list[lanes.Head]
) -> tuple[set[int], dict[int, int]]:
    """Each head into the admission slot of its lane's predecessors in this message; returns
    those predecessors (their slots are free now) and the heads now counted in flight (id ->
    route). Nothing when admission is off, and nothing on a Redis failure (logged: the heads
    go out uncounted, the slots are released as usual, and the reconcile corrects the
    count)."""
    if not rt.settings.admission or not heads:
        return set(), {}
    before: dict[tuple[int, str], list[int]] = {}
    for report in moved:
        if report.lane is not None and report.route_id is not None:
            before.setdefault(report.lane, []).append(report.delivery_id)
    lanes_moved = [(h.lane, h.delivery_id) for h in heads if h.lane in before]
    plan = [(lane[0], head, before[lane]) for lane, head in lanes_moved if lane is not None]
    if not plan:
        return set(), {}
    try:
        taken = Admission(rt.redis).hand_over(plan)
    except Exception as exc:  # noqa: BLE001 (the release and the reconcile free the slots)
        log.warning("delivery.hand_over_failed", error_class=type(exc).__name__)
        return set(), {}
    handed = [step for step, ok in zip(plan, taken, strict=True) if ok]
    return {i for _, _, ids in handed for i in ids}, {head: route for route, head, _ in handed}


def unpublished(rt: Runtime, counted: dict[int, int]) -> None:
    """Heads whose publish failed leave the slots they were handed: not in flight, so the
    sweeper's next pick publishes them (it leaves admission's members alone) instead of
    waiting for the reconcile to find them pending past the grace."""
    if not counted:
        return
    by_route: dict[int, list[int]] = {}
    for head, route in counted.items():
        by_route.setdefault(route, []).append(head)
    try:
        Admission(rt.redis).release(by_route)
    except Exception as exc:  # noqa: BLE001 (the reconcile frees them after the grace)
        log.warning("delivery.release_failed", error_class=type(exc).__name__)


def release_slots(rt: Runtime, reports: list[Report]) -> None:
    """Free the admission slots (models/admission.py) of the attempts that finished here, at
    once, and wake this process's dispatcher to fill them: a route at its in-flight budget
    gets its next delivery now, not after the next reconcile (which still frees whatever this
    misses: a failure here is logged and changes nothing else). Without it a lone route ran
    well under its budget's worth of concurrent calls (bench_forward: 0.58x main at budget 40).
    Where the dispatcher runs in this process (threads, gevent), it releases them in its next
    round, all tasks' at once (:func:`tasks.dispatcher.defer_release`)."""
    if not rt.settings.admission:
        return
    done: dict[int, list[int]] = {}
    for report in reports:
        if report.route_id is not None:
            done.setdefault(report.route_id, []).append(report.delivery_id)
    if not done:
        return
    if dispatcher.defer_release(done):
        return  # this process's dispatcher releases them in its next round, with the others
    try:
        Admission(rt.redis).release(done)
    except Exception as exc:  # noqa: BLE001 (the dispatcher's reconcile frees them later)
        log.warning("delivery.release_failed", error_class=type(exc).__name__)
        return
    dispatcher.wake()
