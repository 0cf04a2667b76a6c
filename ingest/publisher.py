"""Publishing delivery ids to Celery after the commit (never before).

The receiver hands committed delivery ids to :meth:`Publisher.submit` and answers at once; a
background thread publishes whatever has accumulated in one kombu producer batch (a single
Redis pipeline round trip for many messages). A publish failure is counted and logged: the
delivery rows are already durable and pending, and the sweeper publishes them after
``publish_grace``. So the 202 never depends on the broker, and a crash between the commit and
the publish costs latency, never an event.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from tasks.config import DELIVER_TASK, DELIVERIES_QUEUE, create_app
from webhooks import metrics
from webhooks.logs import get_logger
from webhooks.settings import Settings

log = get_logger("ingest.publisher")

MAX_BATCH = 500
_STOP = ("", -1)


class Publisher:
    def __init__(self, settings: Settings) -> None:
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
        self._queue: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, label: str, delivery_ids: Sequence[int]) -> None:
        """Queue committed delivery ids for publishing; never blocks on the broker."""
        if self._thread is None:
            self._start()
        for delivery_id in delivery_ids:
            self._queue.put((label, delivery_id))

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = _STOP in batch
            batch = [item for item in batch if item != _STOP]
            if batch:
                self._publish_batch(batch)
            if stopping:
                return

    def _publish_batch(self, batch: list[tuple[str, int]]) -> None:
        try:
            self.publish_sync([delivery_id for _, delivery_id in batch])
        except Exception as exc:  # noqa: BLE001  (durable already; the sweeper publishes)
            for label, _ in batch:
                metrics.PUBLISH_FAILURES.labels(label).inc()
            log.warning("publish_failed", deliveries=len(batch), error=exc.__class__.__name__)

    def publish_sync(self, delivery_ids: Sequence[int]) -> None:
        """Publish now, in one producer batch where the transport supports it."""
        with self.app.producer_or_acquire() as producer:
            batch = getattr(producer, "batch", None)  # kombu >= 5.7: one Redis round trip
            if batch is None:
                for delivery_id in delivery_ids:
                    self.app.send_task(
                        DELIVER_TASK, args=[delivery_id], queue=DELIVERIES_QUEUE, producer=producer
                    )
                return
            with batch(max_size=MAX_BATCH):
                for delivery_id in delivery_ids:
                    self.app.send_task(
                        DELIVER_TASK, args=[delivery_id], queue=DELIVERIES_QUEUE, producer=producer
                    )

    def ping(self) -> None:
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=max(1, int(self.timeout)))

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout)
