"""A worker that cannot reach Postgres stops taking deliveries until it can again.

A worker host cut off from Postgres (it still reaches the broker) used to take its share of
the queue all the same: each message waited for the database's connect or dead-peer timeout,
was acknowledged, and came back only with the sweeper's pick after the publish grace. With
three hosts, a third of the traffic stalled for the length of the cut (issue 32's drill: the
other hosts at 0.55x their throughput before it).

Now the task that meets an unreachable database (:func:`tasks.deliver.deliver_message`)
publishes a copy of its message for another worker to take at once
(:func:`tasks.deliver.requeue`; not ``Reject(requeue=True)``, which Celery logs with a
traceback) and asks its own worker, through the broker's control channel, to pause
(:data:`PAUSE_COMMAND`). The worker's main process stops consuming the deliveries queue and
probes the database (``SELECT 1``) every :data:`PROBE_EVERY_S`; once it answers, the worker
consumes again. One line each way: ``worker.deliveries_paused`` (with the error's class) and
``worker.deliveries_resumed`` (with how long). Under every pool: a prefork child cannot reach
its parent's consumer, the control channel can.

Fails towards consuming: a pause request that is lost (the broker was unreachable too) leaves
the worker as before (the next failure asks again); a resume is sent until the worker is seen
consuming again.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
from celery import Celery
from celery.worker.control import control_command

from core.logs import get_logger
from core.messages import DELIVERIES_QUEUE
from core.settings import Settings

log = get_logger(__name__)

PAUSE_COMMAND = "webhooks_pause_deliveries"
# How often a paused worker tries the database, and how long one try may take.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2
# A resume not seen taking effect within this long is sent again (a control message is lost
# when the worker's control consumer is reconnecting).
RESUME_CHECK_S = 2.0


def request_pause(app: Celery, hostname: str | None, error_class: str) -> None:
    """Ask the worker ``hostname`` (this task's own) to pause taking deliveries. Never
    raises: a request that cannot be sent leaves the worker consuming."""
    if not hostname:
        return
    try:
        app.control.broadcast(
            PAUSE_COMMAND,
            arguments={"error_class": error_class},
            destination=[hostname],
            reply=False,
        )
    except Exception as exc:  # noqa: BLE001 (the broker is unreachable too: nothing paused)
        log.warning("worker.pause_not_sent", error_class=type(exc).__name__)


class DeliveriesGate:
    """The worker's side, in its main process: pause (stop consuming, start probing) and
    resume once the database answers."""

    def __init__(self, app: Celery, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self._lock = threading.Lock()
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self, consumer: Any, error_class: str) -> None:
        """Run by the control command, in the consumer's thread: stop consuming the
        deliveries queue (messages already taken finish) and probe until the database
        answers."""
        with self._lock:
            if self._paused or not _consuming(consumer):
                return  # paused already, or a worker that does not take deliveries
            self._paused = True
        consumer.cancel_task_queue(DELIVERIES_QUEUE)
        log.warning(
            "worker.deliveries_paused",
            error_class=error_class,
            probe_every_s=PROBE_EVERY_S,
        )
        threading.Thread(
            target=self._probe_then_resume,
            args=(consumer,),
            name="webhooks-database-probe",
            daemon=True,
        ).start()

    def reachable(self) -> bool:
        """Whether the database answers a ``SELECT 1`` now."""
        try:
            with psycopg.connect(
                self.settings.psycopg_dsn, connect_timeout=PROBE_TIMEOUT_S, autocommit=True
            ) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def _probe_then_resume(self, consumer: Any) -> None:
        started = time.monotonic()
        while not self.reachable():
            time.sleep(PROBE_EVERY_S)
        # Through the control channel, so that the consumer changes in its own thread;
        # sent again until it takes effect.
        while not _consuming(consumer):
            try:
                self.app.control.add_consumer(
                    DELIVERIES_QUEUE, destination=[consumer.hostname], reply=False
                )
            except Exception as exc:  # noqa: BLE001 (the broker is away: try again)
                log.warning("worker.resume_not_sent", error_class=type(exc).__name__)
            deadline = time.monotonic() + RESUME_CHECK_S
            while not _consuming(consumer) and time.monotonic() < deadline:
                time.sleep(0.05)
        with self._lock:
            self._paused = False
        log.info("worker.deliveries_resumed", paused_s=round(time.monotonic() - started, 1))


def _consuming(consumer: Any) -> bool:
    tasks = consumer.task_consumer
    return bool(tasks is not None and tasks.consuming_from(DELIVERIES_QUEUE))


def register(app: Celery, settings: Settings) -> DeliveriesGate:
    """The gate of this worker and its control command (run in the worker's main process)."""
    gate = DeliveriesGate(app, settings)

    def pause(state: Any, error_class: str = "", **_: Any) -> dict[str, str]:
        gate.pause(state.consumer, error_class)
        return {"ok": "pausing deliveries"}

    control_command(name=PAUSE_COMMAND, args=[("error_class", str)])(pause)
    return gate
