"""Publishing delivery ids to Celery after the commit (never before).

The receiver hands committed delivery ids to :meth:`Publisher.submit` and answers at once; a
background thread publishes whatever has accumulated, packed into messages of up to
``WEBHOOKS_DELIVERY_BATCH`` delivery ids (one id when it found one: light load keeps one
message per delivery), with a Redis broker as one LPUSH for the whole lot. Under load it
lingers ``WEBHOOKS_PUBLISH_LINGER`` for the rest of a burst, five times that while the queue
holds :data:`BACKLOG_MESSAGES` or more messages no worker has taken (the LPUSH's reply
tells): the workers are behind, and fewer, fuller messages are what lets them catch up. A
publish failure is counted and logged: the delivery rows are already durable and pending,
and the sweeper publishes them after ``publish_grace``. So the 202 never depends on the
broker, and a crash between the commit and the publish costs latency, never an event.

The thread cannot die silently. Whatever ends its loop (an exception raised while handling a
failure, a ``BaseException``) is one counted, logged death, and a new thread takes over
after :data:`RESTART_DELAY` (a fault that repeats costs one line a second, not a busy loop);
``/readyz`` is red in between (:meth:`Publisher.running`). The deliveries the dead thread
held are left to the sweeper (counted): they may be what killed it. Its queue holds at most
``WEBHOOKS_PUBLISH_QUEUE_LIMIT`` deliveries: past that (a broker slower than the receiver,
a thread restarting) :meth:`Publisher.submit` leaves them pending for the sweeper, counted,
instead of holding memory without limit.

Admission (models/admission.py) decides first: each batch's deliveries go out at once while
their route is under its in-flight budget and rate limit; the others stay pending, waiting
for the dispatcher (tasks/dispatcher.py), with no message.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import redis
from kombu.utils import json as kombu_json

from core import metrics, tracing
from core.logs import get_logger
from core.messages import DELIVER_TASK, DELIVERIES_QUEUE, Dispatch, batches, message
from core.settings import Settings
from models.admission import connect_generic, offer
from tasks.claims import make_client
from tasks.config import create_app

log = get_logger("tasks.publisher")

MAX_BATCH = 500
# How much longer the publisher lingers while the workers have a backlog (see Publisher),
# and how many messages waiting in the queue make one (fewer are the jitter of workers that
# keep up: stretching the linger for them only added latency, bench/results_workers.txt).
BACKLOG_LINGER = 5
BACKLOG_MESSAGES = 16
_STOP = ("", Dispatch(-1))
# Seconds between a publisher thread's death and the start of its replacement.
RESTART_DELAY = 1.0

# Called with each batch the thread is about to publish (tests inject a fault here).
BeforePublish = Callable[[Sequence[Dispatch]], None]


def spans_for(spans: contextlib.ExitStack, dispatches: Sequence[Dispatch]) -> list[Dispatch]:
    """Each traced dispatch with a publish span of its own (open until ``spans`` closes, after
    the send), the child of its event's accept; the message carries the publish span's
    traceparent, which the worker's spans continue (one trace per event)."""
    out = []
    for d in dispatches:
        if not d.trace:
            out.append(d)
            continue
        attributes = {"webhooks.delivery_id": d.delivery_id, "messaging.system": "celery"}
        child = spans.enter_context(
            tracing.span("webhooks.publish", parent=d.trace, kind="producer", attributes=attributes)
        )
        out.append(d._replace(trace=child or d.trace))
    return out


class Publisher:
    def __init__(
        self,
        settings: Settings,
        *,
        restart_delay: float = RESTART_DELAY,
        before_publish: BeforePublish | None = None,
    ) -> None:
        self.app = create_app(settings)
        transport = dict(self.app.conf.broker_transport_options or {})
        transport.update(
            socket_timeout=settings.publish_timeout,
            socket_connect_timeout=settings.publish_timeout,
            max_retries=0,
        )
        self.app.conf.update(
            task_publish_retry=False,
            broker_connection_timeout=settings.publish_timeout,
            broker_connection_retry=False,
            broker_connection_max_retries=0,
            broker_transport_options=transport,
        )
        self.timeout = settings.publish_timeout
        self.settings = settings
        # Deliveries found queued together go out as messages of up to this many ids.
        self.batch = settings.deliveries_per_message
        self.linger = settings.publish_linger
        self._last_taken = -math.inf
        # Messages found waiting in the queue by the last LPUSH (its reply is the list's
        # length): the workers are not keeping up, so lingering longer costs no latency the
        # queue does not already add, and bigger messages help them catch up.
        self.backlog = 0
        self._queue: queue.SimpleQueue[tuple[str, Dispatch]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._producer: Any = None
        self._client: redis.Redis | None = None
        self._redis_broker = settings.broker_url.startswith(("redis://", "rediss://"))
        self._lock = threading.Lock()
        self.queue_limit = settings.publish_queue_limit
        self.restart_delay = restart_delay
        self.before_publish = before_publish
        # Taken off the queue and not yet published: what a dying thread leaves behind.
        self._holding: list[tuple[str, Dispatch]] = []
        # Between a death and the replacement's start (and set by close(): no restart).
        self._down = False
        self._closed = threading.Event()
        # Admission's connections (the publisher thread's own; models/admission.py).
        self._admission_conn: psycopg.Connection[Any] | None = None
        self._admission_redis: redis.Redis | None = None

    def submit(self, label: str, dispatches: Sequence[Dispatch]) -> None:
        """Queue committed deliveries for publishing; never blocks on the broker. Past the
        queue's limit a delivery stays pending for the sweeper (counted, never queued)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._start()
        deferred = 0
        for dispatch in dispatches:
            # One producer (the event loop) in practice: the bound is exact; with several,
            # it is exceeded by at most one delivery per concurrent caller.
            if self._queue.qsize() >= self.queue_limit:
                deferred += 1
            else:
                self._queue.put((label, dispatch))
        if deferred:
            metrics.PUBLISH_DEFERRED.labels(label, "queue_full").inc(deferred)
            log.warning(
                "publish_deferred", reason="queue_full", deliveries=deferred, limit=self.queue_limit
            )

    def running(self) -> bool:
        """False while the thread is dead and not yet replaced (``/readyz`` goes red). Not
        started yet (nothing submitted) counts as running: it starts on the first submit."""
        thread = self._thread
        return not self._down and (thread is None or thread.is_alive())

    def _start(self, replacing: threading.Thread | None = None) -> None:
        """Start the thread: the first time, or in place of ``replacing`` (its dying self) or
        of one found dead (a death even the supervision could not handle)."""
        with self._lock:
            current = self._thread
            if current is not None and current is not replacing and current.is_alive():
                return
            if current is not None and self._closed.is_set():
                return
            # A fresh thread starts quiet: its first delivery goes out at once.
            self._last_taken = -math.inf
            self._down = False
            thread = threading.Thread(target=self._supervised, name="publisher", daemon=True)
            thread.start()
            self._thread = thread

    def _supervised(self) -> None:
        """The thread's body: the publishing loop; when it dies, one counted line and, after
        :attr:`restart_delay`, a replacement."""
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001  (any death is counted and survived)
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        self._down = True
        try:
            held = [item for item in self._holding if item != _STOP]
            self._holding = []
            metrics.PUBLISHER_DEATHS.inc()
            for label, _ in held:
                metrics.PUBLISH_DEFERRED.labels(label, "publisher_died").inc()
            log.error(
                "publisher_died",
                error=exc.__class__.__name__,
                deliveries=len(held),
                restart_in=self.restart_delay,
            )
        finally:
            if not self._closed.wait(self.restart_delay):
                self._start(replacing=threading.current_thread())

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            self._holding = batch  # grows in place while lingering
            # Linger, under load only: when deliveries arrive this close together, the next
            # ones (the rest of a group commit) are a few requests behind; a lone delivery
            # after a quiet spell goes out at once.
            now = time.monotonic()
            linger = self.linger * (BACKLOG_LINGER if self.backlog >= BACKLOG_MESSAGES else 1)
            if now - self._last_taken < linger and self._queue.qsize() < MAX_BATCH - 1:
                # One sleep for the whole linger, then take what came. Waiting on the queue
                # instead woke this thread at every submit, and each wake took the GIL from
                # the event loop that serves the requests (issue 24). close() cuts it short.
                self._closed.wait(linger)
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._last_taken = time.monotonic()
            stopping = _STOP in batch
            batch = [item for item in batch if item != _STOP]
            self._holding = batch
            if batch:
                if self.before_publish is not None:
                    self.before_publish([dispatch for _, dispatch in batch])
                self._publish_batch(batch)
            self._holding = []
            if stopping:
                return

    def _publish_batch(self, batch: list[tuple[str, Dispatch]]) -> None:
        try:
            dispatches = self.admitted([dispatch for _, dispatch in batch])
            if dispatches:
                self.publish_sync(dispatches)
        except Exception as exc:  # noqa: BLE001  (durable already; the sweeper publishes)
            self._drop_producer()
            for label, _ in batch:
                metrics.PUBLISH_FAILURES.labels(label).inc()
            log.warning("publish_failed", deliveries=len(batch), error=exc.__class__.__name__)

    def admitted(self, dispatches: Sequence[Dispatch]) -> Sequence[Dispatch]:
        """What admission lets out now (models/admission.py: one Lua call for the batch; the
        routes' limits came with the accept, so no statement unless a dispatch lacks them);
        the rest wait for the dispatcher as pending rows. A failure of either fails open
        (everything published, as before admission), counted."""
        if not self.settings.admission:
            return dispatches
        try:
            if self._admission_redis is None:
                self._admission_redis = make_client(
                    self.settings.redis_url, self.settings.redis_socket_timeout
                )
            return offer(
                self._admission_redis,
                self._admission_connection,
                dispatches,
                self.settings.route_max_in_flight,
            )
        except Exception as exc:  # noqa: BLE001 (fail open: see the docstring)
            metrics.ADMISSIONS.labels("failed_open").inc(len(dispatches))
            metrics.FAIL_OPEN_LAST.set_to_current_time()
            log.warning(
                "admission_failed_open", deliveries=len(dispatches), error=type(exc).__name__
            )
            if self._admission_conn is not None:
                with contextlib.suppress(Exception):
                    self._admission_conn.close()
            self._admission_conn = None
            return dispatches

    def _admission_connection(self) -> psycopg.Connection[Any]:
        """Admission's Postgres connection, opened when a dispatch without its route's limits
        needs one (a replay's): the receiver's own carry them."""
        if self._admission_conn is None or self._admission_conn.closed:
            self._admission_conn = connect_generic(self.settings.psycopg_dsn)
        return self._admission_conn

    def publish_sync(self, dispatches: Sequence[Dispatch]) -> None:
        """Publish now; raises on failure. One thread per Publisher calls this: the background
        thread behind :meth:`submit`, or a caller that never uses submit (replays)."""
        if tracing.STATE.on and any(d.trace for d in dispatches):
            with contextlib.ExitStack() as spans:
                self._publish(spans_for(spans, dispatches))
            return
        self._publish(dispatches)

    def _publish(self, dispatches: Sequence[Dispatch]) -> None:
        if self._redis_broker:
            self._lpush(dispatches)
            return
        producer = self._get_producer()
        for group in batches(dispatches, self.batch):
            args, options = message(group, self.settings)
            self.app.send_task(
                DELIVER_TASK, args=args, queue=DELIVERIES_QUEUE, producer=producer, **options
            )

    def _lpush(self, dispatches: Sequence[Dispatch]) -> None:
        """The Redis broker path: Celery builds each message (``as_task_v2``), kombu's channel
        turns it into the transport's wire form, and the whole batch is one LPUSH.

        ``send_task`` would spend about 0.5 ms of CPU per message on this machine (a fresh
        Redis client object per publish, the retry policy, a task-sent event), more than the
        rest of the request together. Messages published here have no task-sent event:
        Flower shows them from the moment a worker receives them.
        """
        channel = self._get_producer().channel
        amqp = self.app.amqp
        wire = []
        for group in batches(dispatches, self.batch):
            args, options = message(group, self.settings)
            extra = options.pop("headers", None)
            headers, properties, body, _ = amqp.as_task_v2(
                str(uuid.uuid4()), DELIVER_TASK, args=args, **options
            )
            if extra:
                headers.update(extra)
            wire_message = channel.prepare_message(
                json.dumps(body),
                0,
                "application/json",
                "utf-8",
                headers,
                {**properties, "delivery_mode": 2},
            )
            channel._inplace_augment_message(wire_message, "", DELIVERIES_QUEUE)  # noqa: SLF001
            wire.append(kombu_json.dumps(wire_message))
        length = self._redis().lpush(channel._q_for_pri(DELIVERIES_QUEUE, 0), *wire)  # noqa: SLF001
        self.backlog = max(0, int(length) - len(wire))

    def _redis(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(
                self.app.conf.broker_url,
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
            )
        return self._client

    def _get_producer(self) -> Any:
        if self._producer is None:
            self._producer = self.app.amqp.Producer(self.app.connection_for_write())
        return self._producer

    def _drop_producer(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                self._producer.connection.close()
            self._producer = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    def ping(self) -> None:
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=max(1, int(self.timeout)))

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then stop the thread (a dead one is not replaced: what it
        left queued is pending in Postgres, for the sweeper)."""
        with self._lock:
            self._closed.set()
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout)


class CeleryPublisher:
    """Replays' and reconciliation's publisher: ``webhooks.deliver`` messages, without
    blocking on a dead broker.

    A replay hands it each chunk's moved deliveries at once (:data:`models.replays.Publish`),
    published in messages of up to ``WEBHOOKS_DELIVERY_BATCH`` ids, as the receiver's are: a
    worker pays its per-message cost once per message, not once per delivery. Reuses the
    receiver's fail-fast Celery configuration; a failure returns False (the deliveries are
    pending in Postgres and the sweeper publishes them after ``publish_grace``).
    """

    def __init__(self, settings: Settings) -> None:
        self._publisher = Publisher(settings)

    def __call__(self, dispatches: Sequence[Dispatch]) -> bool:
        if not dispatches:
            return True
        try:
            admitted = self._publisher.admitted(dispatches)
            if admitted:  # the others wait for the dispatcher, at their routes' limits
                self._publisher.publish_sync(admitted)
        except Exception as exc:  # noqa: BLE001  (any broker failure: the sweeper recovers)
            log.warning(
                "replay.publish_failed",
                delivery_ids=[d.delivery_id for d in dispatches],
                error=exc.__class__.__name__,
            )
            return False
        return True

    def one(self, delivery_id: int, event_id: str, source: str) -> bool:
        """One delivery (reconciliation's :data:`tasks.reconcile.run.Publish`)."""
        return self([Dispatch(delivery_id, event_id, source)])

    def close(self) -> None:
        self._publisher.close()
        self._publisher.app.close()
