"""Publishing delivery ids to Celery after the commit (never before)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tasks.config import DELIVER_TASK, DELIVERIES_QUEUE, create_app
from webhooks.settings import Settings


class Publisher:
    """Sends one message per delivery carrying its id only.

    kombu is synchronous, so publishing runs on a small thread pool and never blocks the
    event loop. A failure is reported to the caller, which counts it: the delivery row is
    already durable and pending, and the sweeper publishes it after ``publish_grace``.
    """

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self.app.conf.update(
            task_publish_retry=False,
            broker_connection_timeout=settings.publish_timeout,
            broker_connection_retry=False,
            broker_connection_max_retries=0,
        )
        transport = dict(self.app.conf.broker_transport_options or {})
        transport.update(
            socket_timeout=settings.publish_timeout,
            socket_connect_timeout=settings.publish_timeout,
            max_retries=0,
        )
        self.app.conf.broker_transport_options = transport
        self.timeout = settings.publish_timeout
        self._executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="publish")

    def publish_sync(self, delivery_ids: Sequence[int]) -> None:
        for delivery_id in delivery_ids:
            self.app.send_task(DELIVER_TASK, args=[delivery_id], queue=DELIVERIES_QUEUE)

    async def publish(self, delivery_ids: Sequence[int]) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(
            loop.run_in_executor(self._executor, self.publish_sync, delivery_ids), self.timeout
        )

    def ping(self) -> None:
        with self.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=max(1, int(self.timeout)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
