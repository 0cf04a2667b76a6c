"""The claim and the success of messages of one id, shared by the threads that reach them
at once (:mod:`tasks.combine`; issue 33 item 2).

A message of one bare id (a retry's countdown copy, an isolated delivery, a publisher set
to one id per message) is its own batch of one: alone, it paid three statements and two
Redis round trips for one delivery (bench/results_workers.txt: 0.49x a bare Celery task's
events/s, ~2.9 ms of worker CPU per event against ~0.6 at 16 ids per message). Here the
bare ids whose threads reach step 0-2 together are claimed by one call of
:func:`tasks.steps.claim.claim` (one probe, one pipeline of fast claims, one guarded claim
per partition), each still a message alone (never isolated: it is already); the successes
whose handlers return together are recorded by one call of
:func:`tasks.steps.record.finish`. Each message gets back exactly its own deliveries'
claims and reports; every guard is the statement's, per row, as in a message of several.
Retries and isolations a shared call publishes go through the publish of the message that
carried the delivery.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from core.messages import Dispatch
from core.metrics import SHARED_STEPS
from tasks.combine import Combiner
from tasks.runtime import Runtime
from tasks.steps.claim import Claimed, claim
from tasks.steps.outcome import PublishRetry, Report
from tasks.steps.record import Done, finish

#: The claim of a bare id: its delivery id and its message's retry publisher.
ClaimRequest = tuple[int, PublishRetry]
#: The successes of one message to record, with its retry publisher.
FinishRequest = tuple[list[Done], PublishRetry]


class _Shared:
    """One runtime's combiners (the worker process has one runtime; tests build several)."""

    def __init__(self, rt: Runtime) -> None:
        limit = max(1, rt.settings.deliveries_per_message * 4)
        self.claims: Combiner[ClaimRequest, Claimed | Report] = Combiner(
            lambda requests: _claim_together(rt, requests), limit=limit
        )
        self.finishes: Combiner[FinishRequest, list[Report]] = Combiner(
            lambda requests: _finish_together(rt, requests), limit=limit
        )


_LOCK = threading.Lock()


def shared(rt: Runtime) -> _Shared:
    """``rt``'s combiners, made on first use (kept in its ``steps`` state)."""
    found = rt.steps.get(__name__)
    if found is None:
        with _LOCK:
            found = rt.steps.get(__name__)
            if found is None:
                found = rt.steps[__name__] = _Shared(rt)
    assert isinstance(found, _Shared)
    return found


def _route(requests: Sequence[tuple[object, PublishRetry]], ids: list[list[int]]) -> PublishRetry:
    """A publish that sends each delivery's copy through its own message's publisher."""
    by_id = {i: publish for (_, publish), owned in zip(requests, ids, strict=True) for i in owned}

    def publish(dispatch: Dispatch, countdown: float) -> None:
        by_id[dispatch.delivery_id](dispatch, countdown)

    return publish


def _counted(step: str, requests: int) -> None:
    SHARED_STEPS.labels(step=step, counted="requests").inc(requests)
    SHARED_STEPS.labels(step=step, counted="calls").inc()


def _claim_together(rt: Runtime, requests: list[ClaimRequest]) -> list[Claimed | Report]:
    _counted("claim", len(requests))
    ids = [delivery_id for delivery_id, _ in requests]
    reports: dict[int, Report] = {}
    publish = _route(requests, [[i] for i in ids])
    claimed = {c.found.id: c for c in claim(rt, ids, reports, publish, isolate=False)}
    return [claimed.get(i) or reports[i] for i in ids]


def claim_alone(
    rt: Runtime, delivery_id: int, reports: dict[int, Report], publish_retry: PublishRetry
) -> list[Claimed]:
    """Steps 0-2 of a message of one bare id, with the other bare ids being claimed at this
    moment in this process: its claim, or its report in ``reports``."""
    got = shared(rt).claims.submit((delivery_id, publish_retry), [delivery_id])
    if isinstance(got, Report):
        reports[delivery_id] = got
        return []
    return [got]


def _finish_together(rt: Runtime, requests: list[FinishRequest]) -> list[list[Report]]:
    _counted("succeed", len(requests))
    owned = [[d.claimed.found.id for d in done] for done, _ in requests]
    publish = _route(requests, owned)
    done = [d for ds, _ in requests for d in ds]
    reports = {r.delivery_id: r for r in finish(rt, done, publish)}
    return [[reports[i] for i in ids if i in reports] for ids in owned]


def finish_alone(rt: Runtime, done: list[Done], publish_retry: PublishRetry) -> list[Report]:
    """Step 4 of a message of one bare id, with the successes being recorded at this moment
    in this process."""
    if not done:
        return []
    return shared(rt).finishes.submit((done, publish_retry), [d.claimed.found.id for d in done])
