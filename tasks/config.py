"""The Celery configuration, in one place, derived from Settings.

Time budgets: handler I/O timeout < soft limit < hard limit < processing TTL (4 x hard)
< visibility timeout (checked by Settings). Retry countdowns are capped at
visibility_timeout - hard_limit; longer delays are scheduled by the sweeper. The task and
queue names are the message contract's (:mod:`core.messages`).
"""

from __future__ import annotations

import math
from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from core.messages import (
    DELIVER_TASK,
    DELIVERIES_QUEUE,
    DRIFT_TASK,
    MAINTENANCE_QUEUE,
    MAINTENANCE_TASK,
    RECONCILE_TASK,
    RECONCILE_TICK,
    SWEEP_TASK,
    WATCH_TASK,
    WATCH_TICK,
    batch_time_limits,
)
from core.settings import Settings


def deliver_annotations(settings: Settings) -> dict[str, dict[str, Any]]:
    """The delivery task's own Celery limits, where they differ from every task's.

    Under gevent, Celery's limits on a message of one delivery are a backstop, as on a
    batch's message (:func:`core.messages.batch_time_limits`): there every handler already
    runs under a soft and a hard ``gevent.Timeout`` of its own, both counted from the
    handler's start (:func:`tasks.pools.time_limits`), as the thread pool's watchdog counts
    them. Celery's hard ``gevent.Timeout`` at the hard limit itself was counted from the
    task's start, before the claim: a claim slower than the gap between the two limits (a
    loaded host) had it fire first, so that handler never got its soft limit and was stopped
    before it had run for the hard limit. Prefork keeps Celery's limits (they are its only
    ones, the soft and the hard counted from the same start); threads ignore them."""
    if settings.worker_pool != "gevent":
        return {}
    hard, soft = batch_time_limits(settings)
    return {DELIVER_TASK: {"time_limit": hard, "soft_time_limit": soft}}


def celery_config(settings: Settings) -> dict[str, Any]:
    # Rounded up: the visibility timeout must stay above the budgets it was checked against.
    transport: dict[str, Any] = {"visibility_timeout": math.ceil(settings.visibility_timeout)}
    # Kombu's Redis transport keeps 10 connections for acks and publishes by default: with
    # ~100 greenlets acking at once it raises "Too many connections". One per slot, plus room.
    transport["max_connections"] = max(10, settings.worker_slots + 10)
    transport["polling_interval"] = settings.broker_poll_interval.total_seconds()
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
        "task_annotations": deliver_annotations(settings),
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        # On a lost broker connection, running deliveries of an unacknowledged message are
        # cancelled (their message comes back; the lease and the fence keep them once). The
        # thread pool cannot cancel one (Celery raises NotImplementedError, a traceback per
        # loss, and stops cancelling the rest): there they run to their end, as the fence
        # allows.
        "worker_cancel_long_running_tasks_on_connection_loss": settings.worker_pool != "threads",
        # The worker's remote-control queue (<name>.celery.pidbox, what Flower's inspect and
        # rate-limit commands reach) is not exclusive. An exclusive one belongs to the
        # connection that declared it: after a partition from RabbitMQ heals, the broker may
        # still hold the worker's old connection while the worker reconnects, its declare is
        # refused with RESOURCE_LOCKED and the worker exits (issue 32's drill, three times).
        # Shared, it is redeclared at once; it still goes away 10 s after its last consumer
        # (auto-delete, control_queue_expires). Redis ignores the flag.
        "control_queue_exclusive": False,
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
            WATCH_TASK: {"queue": MAINTENANCE_QUEUE},
            DRIFT_TASK: {"queue": MAINTENANCE_QUEUE},
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
            # Each source's endpoint at its provider, every WEBHOOKS_WATCH_EVERY.
            "watchdog": {"task": WATCH_TASK, "schedule": WATCH_TICK},
            # Payload shape learning (tasks/drift.py); the run claims its period itself.
            "drift": {"task": DRIFT_TASK, "schedule": settings.drift_every.total_seconds()},
        },
        "timezone": "UTC",
        "enable_utc": True,
    }


def create_app(settings: Settings, *, main: str = "webhooks") -> Celery:
    app = Celery(main)
    app.conf.update(celery_config(settings))
    return app
