"""The worker process: the Celery app built from Settings (:func:`build_app`), the pipeline's
tasks registered on it with this process's runtime, and the signal handlers of the worker's
life (logging, the start-up reports, fork, the watchdog, the dispatcher, shutdown).

The runtime (engine, Redis client, handlers: :mod:`tasks.runtime`) belongs to one
:class:`WorkerProcess`, built here and handed to each task at registration; each pool
process builds its own on first use, and ``worker_process_init`` drops whatever a pool child
inherited from its parent.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from celery import Celery
from celery.signals import (
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from core import tracing
from core.logs import configure_logging, get_logger
from core.settings import Settings
from models.catalog import report_raised_ttls
from models.crash_marks import Held
from models.db import make_engine
from models.route_catalog import active_routes
from models.ttl_fingerprints import Heartbeat
from tasks import crashes, deliver, dispatcher, drift, pause, sweeper
from tasks.config import create_app
from tasks.handlers.registry import load_registry
from tasks.observability import is_worker_command
from tasks.pools import check_pool, set_crash_reporter, start_watchdog
from tasks.reconcile import schedule
from tasks.runtime import Runtime, build_runtime
from tasks.transforms import load_transforms
from tasks.watchdog import schedule as subscriptions


class WorkerProcess:
    """This process's settings and runtime, the runtime built on first use (in each pool
    process, after the fork)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()

    def runtime(self) -> Runtime:
        """This process's engine, Redis client and handlers (built on first use)."""
        if self._runtime is None:
            # Under gevent (or threads) many tasks may ask at once: build one runtime only.
            with self._lock:
                if self._runtime is None:
                    self._runtime = build_runtime(self.settings)
                    tracing.setup("worker")  # only with an OTLP endpoint (core/tracing.py)
        return self._runtime

    def after_fork(self, **_: Any) -> None:
        # A pool child must not reuse the parent's sockets: forget them, build its own lazily.
        if self._runtime is not None:
            self._runtime.forget_after_fork()
            self._runtime = None
        self.configure_logging()

    def close(self, **_: Any) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        tracing.shutdown()  # what is buffered is exported

    def configure_logging(self, **_: Any) -> None:
        configure_logging(self.settings.log_level, json=self.settings.log_json)


def build_app(settings: Settings) -> Celery:
    """The configured app, with the pipeline's tasks and signal handlers registered. Call
    :func:`tasks.observability.setup` first, in a worker (``tasks.__getattr__`` does)."""
    app = create_app(settings)
    if is_worker_command(sys.argv):
        check_pool(settings.worker_pool, sys.argv)
    process = WorkerProcess(settings)
    pause.register(app, settings)
    delivery = deliver.register(app, process.runtime)
    sweeper.register(app, process.runtime, delivery)
    schedule.register(app, process.runtime)
    subscriptions.register(app, process.runtime)
    drift.register(app, process.runtime)

    def report_ttls(sender: Any = None, **_: Any) -> None:
        _report_raised_ttls(settings, sender)

    worker_init.connect(process.configure_logging, weak=False)
    beat_init.connect(process.configure_logging, weak=False)
    worker_init.connect(report_ttls, weak=False)
    worker_init.connect(lambda **_: _report_unknown_handlers(settings), weak=False)
    beat_init.connect(report_ttls, weak=False)
    worker_process_init.connect(process.after_fork, weak=False)
    worker_process_shutdown.connect(process.close, weak=False)
    worker_shutdown.connect(lambda **_: tracing.shutdown(), weak=False)  # a pool of threads
    worker_ready.connect(lambda **_: _start_watchdog(settings), weak=False)
    worker_ready.connect(lambda **_: _start_dispatcher(settings), weak=False)
    # The worker's TTL inputs in Postgres (issue 35 item 3), from its main process once the
    # pool is up (no thread before a fork), refreshed by a thread, deleted at a clean stop.
    fingerprint = Heartbeat(settings, "worker")
    worker_ready.connect(lambda **_: fingerprint.start(wait=False), weak=False)
    worker_shutdown.connect(lambda **_: fingerprint.stop(), weak=False)
    _name_crashes(settings)
    app.set_current()
    return app


def _name_crashes(settings: Settings) -> None:
    """A watchdog about to kill this process marks what it dies for (tasks.crashes); set
    before the pool forks, so prefork children inherit it."""

    def name(suspects: list[Held], bystanders: list[Held]) -> None:
        crashes.report(settings, suspects, bystanders)

    set_crash_reporter(name)


def _report_raised_ttls(settings: Settings, sender: Any) -> None:
    engine = make_engine(settings, pool_size=1)
    try:
        process = "beat" if type(sender).__name__ == "Service" else "worker"
        report_raised_ttls(engine, settings, process=process)
    finally:
        engine.dispose()


def _report_unknown_handlers(settings: Settings) -> None:
    """Once at the worker's start: each active route whose handler (or transform) this worker
    does not know (a deployment that lacks a handler module), before its events start going
    dead with ``unknown_handler`` (``unknown_transform``). An unreachable database is logged
    and skipped, as for the TTLs."""
    log = get_logger("worker")
    known = set(load_registry(settings.handler_modules).names())
    transforms = set(load_transforms(settings.handler_modules).names())
    engine = make_engine(settings, pool_size=1)
    try:
        with Session(engine) as session:
            routes = [
                (r.id, r.handler, source, r.transform) for r, source in active_routes(session)
            ]
    except OperationalError as exc:
        log.warning("routes.handler_check_skipped", error_class=type(exc).__name__)
        return
    finally:
        engine.dispose()
    for route_id, handler, source, transform in routes:
        if transform is not None and transform not in transforms:
            log.error(
                "route.unknown_transform",
                route_id=route_id,
                source=source,
                transform=transform,
                registered=sorted(transforms),
                fix=f"deploy the transform, or webhooks routes update {route_id} --transform none",
            )
        if handler not in known:
            log.error(
                "route.unknown_handler",
                route_id=route_id,
                source=source,
                handler=handler,
                registered=sorted(known),
                fix=f"deploy the handler, or webhooks routes disable {route_id}",
            )


def _start_watchdog(settings: Settings) -> None:
    """gevent: stop a handler that never yields (tasks.pools); prefork's hard limit does it."""
    if start_watchdog(settings.hard_time_limit):
        get_logger("worker").info("worker.watchdog", hard_time_limit=settings.hard_time_limit)


def _start_dispatcher(settings: Settings) -> None:
    """The worker's dispatcher thread (tasks.dispatcher), in its main process."""
    if settings.admission and settings.dispatcher:
        dispatcher.start(settings)
