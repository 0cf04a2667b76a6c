"""The delivery pipeline: the deliveries of one task message, n >= 1, through their steps.

A message carries one delivery id or a list of up to ``WEBHOOKS_DELIVERY_BATCH``
(:func:`tasks.config.batches`); both take the same steps through the same code, a message of
one id being a batch of one: :mod:`tasks.steps.claim` (steps 0-2), :mod:`tasks.steps.run`
(step 3, the handlers at once), :mod:`tasks.steps.record` (steps 4-5). Celery's per-message
work and our round trips are paid once per message, not once per delivery
(bench/results_forward.txt); each delivery keeps its own fate. docs/workers.md ("Why each
effect happens exactly once") argues the guarantees. Logs carry ids, outcomes and error
classes, never payloads or secrets.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from core import tracing
from tasks.pools import in_flight
from tasks.runtime import Runtime
from tasks.steps.claim import Claimed, claim, held_of
from tasks.steps.outcome import Outcome, PublishRetry, Report
from tasks.steps.record import Done, finish
from tasks.steps.run import handler_job, in_waves
from tasks.steps.together import claim_alone, finish_alone

# A handler's success is recorded as soon as it returns, with those of its batch-mates that
# return within this many seconds after it (one statement for a burst): the downstream's 2xx
# stands unrecorded for milliseconds, not for its batch-mates' time (issue 32 item 4:
# bench_forward prints that time's p99, attempts.committed_at - ended_at). One slow or stuck
# handler never holds the others' successes.
COALESCE = 0.01


def run(
    rt: Runtime,
    delivery_ids: Sequence[int],
    *,
    publish_retry: PublishRetry,
    alone: bool = False,
    traces: Mapping[str, str] | None = None,
) -> list[Report]:
    """Run the deliveries of one message; one report per distinct id, in the message's order.

    ``alone``: the message is one bare id, whose Celery time limits are its handler's own, so
    the calling thread runs that handler, under them (a list, even of one, carries the batch
    backstop limits: its handlers get limits of their own, see :func:`in_waves`).
    ``traces``: the message's traceparent of each delivery id (core/tracing.py), when on."""
    ids = list(dict.fromkeys(delivery_ids))
    reports: dict[int, Report] = {}
    started_ns = time.time_ns()
    if alone:  # with the bare ids this process's other threads claim now (steps.together)
        claimed = claim_alone(rt, ids[0], reports, publish_retry)
    else:
        claimed = claim(rt, ids, reports, publish_retry)
    if tracing.STATE.on:
        claimed = traced_claims(claimed, traces or {}, started_ns)
    with in_flight([held_of(c.found) for c in claimed]):
        out = _run_claimed(rt, ids, claimed, reports, publish_retry, inline=alone)
    return with_lanes(out, claimed)


def with_lanes(reports: list[Report], claimed: list[Claimed]) -> list[Report]:
    """Each claimed delivery's report with its lane (models/lanes.py), so that the task
    publishes the lane's next head once it ended."""
    lane = {
        c.found.id: (c.found.route_id, c.found.lane_key)
        for c in claimed
        if c.found.lane_key is not None
    }
    if not lane:
        return reports
    return [
        dataclasses.replace(r, lane=lane[r.delivery_id])
        if r.lane is None and r.delivery_id in lane
        else r
        for r in reports
    ]


def traced_claims(
    claimed: list[Claimed], traces: Mapping[str, str], started_ns: int
) -> list[Claimed]:
    """Each claimed delivery with its claim's span (from before the message's claim to now),
    the child of the publish span its message named; a new trace for a delivery published
    without one (the sweeper's, a retry's, one admission held)."""
    out = []
    for c in claimed:
        attributes = {"webhooks.delivery_id": c.found.id, "webhooks.attempt": c.found.attempt}
        span = tracing.record(
            "webhooks.claim",
            parent=traces.get(str(c.found.id)),
            start_ns=started_ns,
            kind="consumer",
            attributes=attributes,
        )
        out.append(dataclasses.replace(c, trace=span))
    return out


def deliver_one(rt: Runtime, delivery_id: int, *, publish_retry: PublishRetry) -> Outcome:
    """A message of one id (:func:`run`): its outcome."""
    return run(rt, [delivery_id], publish_retry=publish_retry, alone=True)[0].outcome


def _run_claimed(
    rt: Runtime,
    ids: list[int],
    claimed: list[Claimed],
    reports: dict[int, Report],
    publish_retry: PublishRetry,
    *,
    inline: bool,
) -> list[Report]:
    """Steps 3 to 5: the claimed deliveries' handlers, their outcomes recorded."""
    errors: list[BaseException] = []
    jobs = [handler_job(rt, c, publish_retry) for c in claimed]
    for wave in in_waves(rt, jobs, COALESCE, inline=inline):
        done: list[Done] = []
        for index, outcome in wave:
            if isinstance(outcome, Done):
                done.append(outcome)
            elif isinstance(outcome, Report):
                reports[claimed[index].found.id] = outcome
            else:
                # Not a handler error (those are reports): the database failed while
                # recording one. The delivery stays processing; its lease runs out and the
                # sweeper republishes it, as after a crash. Finish the others first.
                errors.append(outcome)
        try:
            if inline:  # a bare id: with the others' successes of this moment
                finished = finish_alone(rt, done, publish_retry)
            else:
                finished = finish(rt, done, publish_retry)
        except Exception as exc:  # noqa: BLE001 (raised once every handler is accounted for)
            # Recording these outcomes failed on a database error that is not a lost
            # connection's (those are retried in finish): their deliveries keep their lease,
            # as after a crash. The handlers still running are waited for and their outcomes
            # recorded first: none is left claimed and forgotten.
            errors.append(exc)
            continue
        for report in finished:
            reports[report.delivery_id] = report
    if errors:
        raise errors[0]
    return [reports[i] for i in ids]
