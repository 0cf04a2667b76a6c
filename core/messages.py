"""The message contract between the receiver, the dispatcher and the workers: the task and
queue names, what one delivery to publish carries (:class:`Dispatch`), and how deliveries
are grouped into task messages. Pure: no broker, no Celery app."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from core.settings import Settings

DELIVER_TASK = "webhooks.deliver"
SWEEP_TASK = "webhooks.sweep"
MAINTENANCE_TASK = "webhooks.maintenance"
RECONCILE_TASK = "webhooks.reconcile"
DRIFT_TASK = "webhooks.drift"
# Beat checks for sources due for reconciliation this often (tasks.reconcile.schedule).
RECONCILE_TICK = 60.0
WATCH_TASK = "webhooks.watch"
# Beat checks for sources whose endpoint is due for the watchdog this often (tasks.watchdog;
# a source's period: WEBHOOKS_WATCH_EVERY).
WATCH_TICK = 60.0
DELIVERIES_QUEUE = "deliveries"
MAINTENANCE_QUEUE = "maintenance"
# The task message header that maps each delivery id (as text) to its event's traceparent
# (core/tracing.py), present only when traces are on.
TRACE_HEADER = "webhooks_traceparents"


# What admission reads of a delivery's route: (route id, max_in_flight, rate_count,
# rate_period_s, held 0/1), NULL (None) where the route has no limit of its own
# (models.admission._LIMITS_COLUMNS; the accept functions return it, migration 0018).
RouteRow = tuple[int | None, ...]


class Dispatch(NamedTuple):
    """One delivery to publish, with what Flower shows of it (ids only, never a payload)."""

    delivery_id: int
    event_id: str | None = None
    source: str | None = None
    # Its route's limits as the accept read them (the receiver's deliveries): admission
    # needs no statement of its own for them. None: admission reads them (routes_of).
    route: RouteRow | None = None
    # Its event's trace (a W3C traceparent, core/tracing.py) when traces are on.
    trace: str | None = None

    def reprs(self) -> dict[str, str]:
        """``argsrepr`` / ``kwargsrepr`` of its task message, the same from every publisher
        (receiver, retry, sweeper, replay): the delivery id as the one argument, and the
        event id and source beside it, so a row in Flower is found by any of the three."""
        return {
            "argsrepr": f"({self.delivery_id},)",
            "kwargsrepr": repr({"event_id": self.event_id, "source": self.source}),
        }


class Message(NamedTuple):
    """One task message of ``webhooks.deliver``: its arguments and publishing options."""

    args: tuple[Any, ...]
    options: dict[str, Any]


def batch_time_limits(settings: Settings) -> tuple[float, float]:
    """Celery's (hard, soft) limits on a message that carries several deliveries.

    Its handlers run concurrently, each under the per-handler limits of :mod:`tasks.pools`
    (soft, hard, and the kill at 1.5 x hard), which end every one of them first; Celery's
    own limits on the whole message are only a backstop above those, and stay below the
    processing TTL (4 x hard) so no lease can run out under a live batch."""
    hard = settings.hard_time_limit
    return 2 * hard, 1.9 * hard


def message(dispatches: Sequence[Dispatch], settings: Settings) -> Message:
    """The message for one delivery (its id as the one argument, as ever) or several (a list
    of ids, with the event ids and sources beside them for Flower, and the batch's limits);
    with the header :data:`TRACE_HEADER` when a delivery carries a trace."""
    options: dict[str, Any]
    if len(dispatches) == 1:
        options = dict(dispatches[0].reprs())
    else:
        ids = [d.delivery_id for d in dispatches]
        hard, soft = batch_time_limits(settings)
        options = {
            "argsrepr": f"({ids!r},)",
            "kwargsrepr": repr(
                {
                    "event_ids": [d.event_id for d in dispatches],
                    "sources": [d.source for d in dispatches],
                }
            ),
            "time_limit": hard,
            "soft_time_limit": soft,
        }
    traces = {str(d.delivery_id): d.trace for d in dispatches if d.trace}
    if traces:
        options["headers"] = {TRACE_HEADER: traces}
    if len(dispatches) == 1:
        return Message((dispatches[0].delivery_id,), options)
    return Message(([d.delivery_id for d in dispatches],), options)


def batches(dispatches: Sequence[Dispatch], size: int) -> list[Sequence[Dispatch]]:
    """Split what is ready to publish into messages of at most ``size`` deliveries, as even as
    possible (33 at 16 -> 11, 11, 11, not 16, 16, 1): a worker runs a message's handlers
    concurrently, so an even split keeps them all busy."""
    if not dispatches:
        return []
    count = -(-len(dispatches) // size)
    base, extra = divmod(len(dispatches), count)
    out: list[Sequence[Dispatch]] = []
    start = 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        out.append(dispatches[start:end])
        start = end
    return out
