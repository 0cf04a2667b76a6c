"""Worker metrics that stay correct across Celery's prefork pool.

Celery's prefork pool forks its children from the main worker process after ``celery -A
tasks worker`` has imported this package; children never import modules afresh. So
prometheus-client's multi-process mode must be chosen in the main process, *before*
``prometheus_client`` is first imported there (it picks its value class at import time):
``tasks.app`` calls :func:`setup` before it imports the task modules, and in a worker
command it points ``PROMETHEUS_MULTIPROC_DIR`` at a directory of our own. Every child then
writes its own ``<type>_<pid>.db`` files there (prometheus-client notices the new pid after
the fork), and the main process serves ``/metrics`` on ``WEBHOOKS_WORKER_METRICS_PORT``
(of ``WEBHOOKS_ADMIN_HOST``, the private address, never the public receiver's host)
through a ``MultiProcessCollector`` that sums them, so counters of children that exited (pool
recycling, ``--max-tasks-per-child``, a crash) still count.

The directory is ``<WEBHOOKS_METRICS_DIR or the temp dir>/worker-<main pid>``: never shared
with the receiver (which ``webhooks run`` points at the same WEBHOOKS_METRICS_DIR) nor with
another worker instance on the host, emptied at start and removed at shutdown; directories
left by a worker that was killed are removed when the next one starts.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from celery.signals import worker_process_shutdown, worker_ready, worker_shutdown

from core.errors import WebhooksError
from core.logs import get_logger
from core.messages import RECONCILE_TICK, WATCH_TICK
from core.settings import Settings

log = get_logger(__name__)

ENV_VAR = "PROMETHEUS_MULTIPROC_DIR"
DIR_PREFIX = "worker-"


class MetricsSetupError(WebhooksError, RuntimeError):
    """Multi-process metrics cannot be set up (prometheus_client was imported too early)."""

    reason = "imported_too_late"


def is_worker_command(argv: Sequence[str]) -> bool:
    """True for ``celery ... worker ...`` (also ``python -m celery``), not beat or flower."""
    if not argv:
        return False
    program = Path(argv[0])
    is_celery = program.name.startswith("celery") or (
        program.name == "__main__.py" and program.parent.name == "celery"
    )
    return is_celery and "worker" in argv[1:]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_dirs(base: Path, alive: Callable[[int], bool]) -> list[Path]:
    """``worker-<pid>`` directories under ``base`` whose worker is gone."""
    found = []
    for child in base.glob(DIR_PREFIX + "*"):
        suffix = child.name.removeprefix(DIR_PREFIX)
        if child.is_dir() and suffix.isdigit() and not alive(int(suffix)):
            found.append(child)
    return found


def metrics_dir(settings: Settings, pid: int) -> Path:
    base = Path(settings.metrics_dir or Path(tempfile.gettempdir()) / "webhooks-metrics")
    return base / f"{DIR_PREFIX}{pid}"


class _Worker:
    settings: Settings | None = None
    directory: Path | None = None


def prepare(settings: Settings, *, pid: int | None = None) -> Path:
    """Choose and empty this worker's metrics directory and export it. Main process only."""
    if "core.metrics" in sys.modules:
        raise MetricsSetupError(
            "core.metrics was imported before tasks.observability.setup: worker metrics "
            "would not add up across pool processes; call tasks.observability.setup first"
        )
    directory = metrics_dir(settings, pid or os.getpid())
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_dirs(directory.parent, pid_alive):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    os.environ[ENV_VAR] = str(directory)
    if "prometheus_client" in sys.modules:
        # The celery command imports flower's CLI plugin, which imports prometheus_client
        # before our app loads. No metric exists yet, so choosing the value class again
        # (now that the directory is exported) puts every metric in multi-process mode.
        from prometheus_client import values  # noqa: PLC0415 (see above)

        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    _Worker.settings = settings
    _Worker.directory = directory
    return directory


def _serve_metrics(**_: Any) -> None:
    """worker_ready (main process, pool already forked): serve the summed metrics."""
    settings, directory = _Worker.settings, _Worker.directory
    if settings is None or directory is None or settings.worker_metrics_port is None:
        return
    from prometheus_client import start_http_server  # noqa: PLC0415 (the metrics server: only a worker that serves one)

    # Imported now, not at the top: prepare() must run before core.metrics is imported.
    from core.metrics import JOB_PERIOD, SettledFiles, exposed  # noqa: PLC0415 (see above)

    # The periodic jobs' periods, beside their last successes (the stale-job alert).
    for job, period in (
        ("sweep", settings.sweep_interval.total_seconds()),
        ("maintenance", settings.maintenance_interval.total_seconds()),
        ("reconcile", RECONCILE_TICK),
        ("watchdog", WATCH_TICK),
        ("drift", settings.drift_every.total_seconds()),
    ):
        JOB_PERIOD.labels(job).set(period)

    summed = SettledFiles(str(directory))
    # The workers' own families only: the receiver's are defined in every process, at zero.
    registry = exposed("worker", summed)
    try:
        start_http_server(settings.worker_metrics_port, addr=settings.admin_host, registry=registry)
    except OSError as exc:
        # Another worker on this host has the port: keep working, say so.
        log.error("worker_metrics.unavailable", port=settings.worker_metrics_port, error=str(exc))
        return
    log.info("worker_metrics.serving", port=settings.worker_metrics_port)


def _child_exit(**_: Any) -> None:
    """worker_process_shutdown (in the exiting child): drop its live-gauge files."""
    if _Worker.directory is None:
        return
    from prometheus_client import multiprocess  # noqa: PLC0415 (only an exiting pool child)

    multiprocess.mark_process_dead(os.getpid(), str(_Worker.directory))  # type: ignore[no-untyped-call]


def _worker_exit(**_: Any) -> None:
    """worker_shutdown (main process): the directory dies with the worker."""
    if _Worker.directory is not None:
        shutil.rmtree(_Worker.directory, ignore_errors=True)


def setup(settings: Settings, argv: Sequence[str]) -> None:
    """In a worker command (not beat, not flower): this worker's metrics directory chosen
    (:func:`prepare`) and its serving and clean-up connected to the worker's signals. Call it
    before anything imports :mod:`core.metrics` (``tasks.__getattr__`` does, first)."""
    if not is_worker_command(argv):
        return
    prepare(settings)
    worker_ready.connect(_serve_metrics, weak=False)
    worker_process_shutdown.connect(_child_exit, weak=False)
    worker_shutdown.connect(_worker_exit, weak=False)
