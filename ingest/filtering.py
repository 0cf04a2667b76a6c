"""The receiver's side of route filters (issue 37 item 1): each event judged against the
filters of its source's routes before the accept statement, which records a route whose
filter did not match as a ``filtered`` delivery and publishes nothing for it (migration 0027).

The filters come with the cached source (:class:`ingest.store.SourceRecord`), so a source
with no filtered route costs nothing here. A cache older than a filter's last change is caught
by the accept itself: it writes nothing and answers ``stale`` when a route holds a filter that
was not judged as it now stands; the source is then read again and the events judged and
accepted once more. A second ``stale`` (the filter changed again meanwhile) answers 503, and
the sender retries.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from core import metrics
from core.filters import FiltersChanged, decide
from ingest.store import SourceRecord, Store
from models.accept import NewReceipt, Outcome


def judged(source: SourceRecord, receipt: NewReceipt, headers: Any) -> NewReceipt:
    """The receipt with the verdicts of its source's filters (none when it has none)."""
    if not source.filters and not receipt.verdicts:
        return receipt
    verdicts = decide(source.filters, receipt.payload, receipt.event_type, headers)
    return replace(receipt, verdicts=verdicts)


async def accept_judged(
    store: Store,
    source: SourceRecord,
    receipts: Sequence[NewReceipt],
    headers: Any,
    run: Callable[[list[NewReceipt]], Awaitable[list[Outcome]]],
) -> list[Outcome]:
    """Judge, accept (``run``), and once more with the source read afresh if the accept found
    a filter it was not judged against; counts each route filtered (the receiver's
    ``webhook`` line names them: ingest.app)."""
    outcomes = await run([judged(source, r, headers) for r in receipts])
    if any(o.status == "stale" for o in outcomes):
        fresh = await store.source(source.public_id, refresh=True)
        if fresh is None:
            raise FiltersChanged(f"source {source.public_id} is gone")
        outcomes = await run([judged(fresh, r, headers) for r in receipts])
        if any(o.status == "stale" for o in outcomes):
            raise FiltersChanged(f"route filters of {source.public_id} changed twice")
    for o in outcomes:
        for route in o.filtered_routes:
            metrics.FILTERED.labels(source.public_id, str(route)).inc()
    return outcomes


def filtered_field(routes: tuple[int, ...]) -> dict[str, list[int]]:
    """The receiver's ``webhook`` line's field naming the routes whose filter kept the
    request's events from their work, when there are any: one line per request."""
    return {"filtered": sorted(set(routes))} if routes else {}
