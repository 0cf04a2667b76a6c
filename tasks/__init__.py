"""The Celery app of the pipeline: ``celery -A tasks worker`` and ``celery -A tasks beat``.

``tasks.app`` is built on first access from the environment (``WEBHOOKS_*``, ``.env``), so
importing a submodule such as ``tasks.config`` or ``tasks.policy`` needs no configuration,
while the Celery command line finds a fully configured app with its tasks registered. Each
worker process builds its own engine and Redis client on first use; ``worker_process_init``
drops whatever a pool child inherited from its parent.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.signals import (
    beat_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
)

from core.logs import configure_logging, get_logger
from core.settings import Settings, load_settings
from tasks.config import create_app

if TYPE_CHECKING:
    from models.db import DatabaseUnavailable
    from tasks.runtime import Runtime

TASK_MODULES = ("tasks.deliver", "tasks.sweeper", "tasks.reconcile.schedule")
# Multi-process metrics for prefork workers.
OBSERVABILITY_MODULE = "tasks.observability"

_settings: Settings | None = None
_app: Celery | None = None
_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get_settings() -> Settings:
    global _settings  # noqa: PLW0603
    if _settings is None:
        _settings = load_settings()
    return _settings


def get_app() -> Celery:
    """The configured app, with the pipeline's tasks and signal handlers registered."""
    global _app  # noqa: PLW0603
    if _app is None:
        settings = get_settings()
        app = create_app(settings)
        # First: it chooses prometheus-client's multi-process mode, which must happen before
        # anything (the task modules, through core.metrics) imports prometheus_client.
        importlib.import_module(OBSERVABILITY_MODULE)
        _check_pool(settings)
        for module in TASK_MODULES:
            importlib.import_module(module)
        worker_init.connect(_configure_logging, weak=False)
        beat_init.connect(_configure_logging, weak=False)
        worker_init.connect(_report_raised_ttls, weak=False)
        worker_init.connect(_report_unknown_handlers, weak=False)
        beat_init.connect(_report_raised_ttls, weak=False)
        worker_process_init.connect(_after_fork, weak=False)
        worker_process_shutdown.connect(_close_runtime, weak=False)
        worker_ready.connect(_start_watchdog, weak=False)
        worker_ready.connect(_start_dispatcher, weak=False)
        _name_crashes(settings)
        app.set_current()
        _app = app
    return _app


def _check_pool(settings: Settings) -> None:
    import sys  # noqa: PLC0415

    from tasks.observability import is_worker_command  # noqa: PLC0415
    from tasks.pools import check_pool  # noqa: PLC0415

    if is_worker_command(sys.argv):
        check_pool(settings.worker_pool, sys.argv)


def _name_crashes(settings: Settings) -> None:
    """A watchdog about to kill this process marks what it dies for (tasks.crashes); set
    before the pool forks, so prefork children inherit it."""
    from models.transitions import Held  # noqa: PLC0415
    from tasks.crashes import report  # noqa: PLC0415
    from tasks.pools import set_crash_reporter  # noqa: PLC0415

    def name(suspects: list[Held], bystanders: list[Held]) -> None:
        report(settings, suspects, bystanders)

    set_crash_reporter(name)


def get_runtime() -> Runtime:
    """This process's engine, Redis client and handlers (built on first use)."""
    from tasks.runtime import build_runtime

    global _runtime  # noqa: PLW0603
    if _runtime is None:
        # Under gevent (or threads) many tasks may ask at once: build one runtime only.
        with _runtime_lock:
            if _runtime is None:
                _runtime = build_runtime(get_settings())
    return _runtime


def periodic_runtime(failed: str) -> Runtime:
    """:func:`get_runtime` for a periodic task (sweep, maintenance, reconcile); when Postgres
    cannot be reached to build it (a worker that started during an outage has no runtime
    until its first statement succeeds), :func:`periodic_failed` raised."""
    from tasks.durable import CONNECTION_ERRORS  # noqa: PLC0415

    try:
        return get_runtime()
    except CONNECTION_ERRORS as exc:
        raise periodic_failed(failed, exc) from None


def periodic_failed(failed: str, exc: BaseException) -> DatabaseUnavailable:
    """What a periodic task raises when its database is unreachable: one warning line,
    ``failed`` with the error's class, never a traceback; then the run ends as FAILURE in
    Flower with ``DatabaseUnavailable`` (declared in the task's ``throws``: Celery logs it as
    expected, without a traceback), not as a SUCCESS that did nothing. The next run retries."""
    from models.db import DatabaseUnavailable  # noqa: PLC0415 (the receiver imports tasks.config)

    name = type(exc).__name__
    get_logger("tasks").warning(failed, error_class=name)
    return DatabaseUnavailable(f"database unavailable ({name}); the next run retries")


def _configure_logging(**_: Any) -> None:
    settings = get_settings()
    configure_logging(settings.log_level, json=settings.log_json)


def _report_raised_ttls(sender: Any = None, **_: Any) -> None:
    from models.catalog import report_raised_ttls  # noqa: PLC0415
    from models.db import make_engine  # noqa: PLC0415

    settings = get_settings()
    engine = make_engine(settings, pool_size=1)
    try:
        process = "beat" if type(sender).__name__ == "Service" else "worker"
        report_raised_ttls(engine, settings, process=process)
    finally:
        engine.dispose()


def _report_unknown_handlers(**_: Any) -> None:
    """Once at the worker's start: each active route whose handler this worker does not know
    (a deployment that lacks a handler module), before its events start going dead with
    ``unknown_handler``. An unreachable database is logged and skipped, as for the TTLs."""
    from sqlalchemy.exc import OperationalError  # noqa: PLC0415
    from sqlalchemy.orm import Session  # noqa: PLC0415

    from core.logs import get_logger  # noqa: PLC0415
    from models.db import make_engine  # noqa: PLC0415
    from models.route_catalog import active_routes  # noqa: PLC0415
    from tasks.handlers.registry import load_registry  # noqa: PLC0415

    log = get_logger("worker")
    settings = get_settings()
    known = set(load_registry(settings.handler_modules).names())
    engine = make_engine(settings, pool_size=1)
    try:
        with Session(engine) as session:
            routes = [(r.id, r.handler, source) for r, source in active_routes(session)]
    except OperationalError as exc:
        log.warning("routes.handler_check_skipped", error_class=type(exc).__name__)
        return
    finally:
        engine.dispose()
    for route_id, handler, source in routes:
        if handler not in known:
            log.error(
                "route.unknown_handler",
                route_id=route_id,
                source=source,
                handler=handler,
                registered=sorted(known),
                fix=f"deploy the handler, or webhooks routes disable {route_id}",
            )


def _after_fork(**_: Any) -> None:
    # A pool child must not reuse the parent's sockets: forget them, build its own lazily.
    global _runtime  # noqa: PLW0603
    if _runtime is not None:
        _runtime.forget_after_fork()
        _runtime = None
    _configure_logging()


def _start_watchdog(**_: Any) -> None:
    """gevent: stop a handler that never yields (tasks.pools); prefork's hard limit does it."""
    from tasks.pools import start_watchdog  # noqa: PLC0415

    if start_watchdog(get_settings().hard_time_limit):
        from core.logs import get_logger  # noqa: PLC0415

        get_logger("worker").info("worker.watchdog", hard_time_limit=get_settings().hard_time_limit)


def _start_dispatcher(**_: Any) -> None:
    """The worker's dispatcher thread (tasks.dispatcher), in its main process."""
    settings = get_settings()
    if settings.admission and settings.dispatcher:
        from tasks.dispatcher import start  # noqa: PLC0415

        start(settings)


def _close_runtime(**_: Any) -> None:
    global _runtime  # noqa: PLW0603
    if _runtime is not None:
        _runtime.close()
        _runtime = None


def __getattr__(name: str) -> Any:
    # `celery -A tasks` looks up `tasks.app`; build it only then.
    if name == "app":
        return get_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
