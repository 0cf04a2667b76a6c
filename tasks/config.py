"""The Celery configuration, in one place, derived from Settings.

Time budgets: handler I/O timeout < soft limit < hard limit < processing TTL (4 x hard)
< visibility timeout (checked by Settings). Retry countdowns are capped at
visibility_timeout - hard_limit; longer delays are scheduled by the sweeper.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from celery import Celery
from kombu import Exchange, Queue

from webhooks.settings import Settings

DELIVER_TASK = "webhooks.deliver"
SWEEP_TASK = "webhooks.sweep"
MAINTENANCE_TASK = "webhooks.maintenance"
RECONCILE_TASK = "webhooks.reconcile"
# Beat checks for sources due for reconciliation this often (tasks.reconcile).
RECONCILE_TICK = 60.0
DELIVERIES_QUEUE = "deliveries"
MAINTENANCE_QUEUE = "maintenance"


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
    of ids, with the event ids and sources beside them for Flower, and the batch's limits)."""
    if len(dispatches) == 1:
        return Message((dispatches[0].delivery_id,), dispatches[0].reprs())
    ids = [d.delivery_id for d in dispatches]
    hard, soft = batch_time_limits(settings)
    return Message(
        (ids,),
        {
            "argsrepr": f"({ids!r},)",
            "kwargsrepr": repr(
                {
                    "event_ids": [d.event_id for d in dispatches],
                    "sources": [d.source for d in dispatches],
                }
            ),
            "time_limit": hard,
            "soft_time_limit": soft,
        },
    )


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


def celery_config(settings: Settings) -> dict[str, Any]:
    # Rounded up: the visibility timeout must stay above the budgets it was checked against.
    transport: dict[str, Any] = {"visibility_timeout": math.ceil(settings.visibility_timeout)}
    # Kombu's Redis transport keeps 10 connections for acks and publishes by default: with
    # ~100 greenlets acking at once it raises "Too many connections". One per slot, plus room.
    transport["max_connections"] = max(10, settings.worker_slots + 10)
    return {
        "broker_url": settings.broker_url,
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_soft_time_limit": settings.soft_time_limit,
        "task_time_limit": settings.hard_time_limit,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "task_default_queue": DELIVERIES_QUEUE,
        "task_queues": (
            Queue(DELIVERIES_QUEUE, Exchange(DELIVERIES_QUEUE), routing_key=DELIVERIES_QUEUE),
            Queue(MAINTENANCE_QUEUE, Exchange(MAINTENANCE_QUEUE), routing_key=MAINTENANCE_QUEUE),
        ),
        "task_routes": {
            DELIVER_TASK: {"queue": DELIVERIES_QUEUE},
            SWEEP_TASK: {"queue": MAINTENANCE_QUEUE},
            MAINTENANCE_TASK: {"queue": MAINTENANCE_QUEUE},
            RECONCILE_TASK: {"queue": MAINTENANCE_QUEUE},
        },
        "worker_concurrency": settings.worker_slots,
        # No worker_pool here: the pool is named with -P, which must match
        # WEBHOOKS_WORKER_POOL (tasks.pools.check_pool).
        "worker_hijack_root_logger": False,
        "beat_schedule": {
            "sweep": {"task": SWEEP_TASK, "schedule": settings.sweep_interval.total_seconds()},
            "maintenance": {
                "task": MAINTENANCE_TASK,
                "schedule": settings.maintenance_interval.total_seconds(),
            },
            # Each source's own period is its --reconcile-every (off by default).
            "reconcile": {"task": RECONCILE_TASK, "schedule": RECONCILE_TICK},
        },
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings, *, main: str = "webhooks") -> Celery:
    app = Celery(main)
    app.conf.update(celery_config(settings))
    return app
