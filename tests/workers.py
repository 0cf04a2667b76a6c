"""Real worker processes for the worker tests, and the helpers around them.

Workers are ``celery -A tasks worker`` subprocesses configured through the environment only
(:func:`tests.conftest.test_env`), with short time budgets so that recovery after ``kill -9``
takes seconds. They use their own Redis databases (broker 10, claims 11) so that the
receiver tests' unconsumed messages on database 14 never reach them, and a ``FLUSHDB`` here
touches nobody else's data.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, Row, text
from sqlalchemy.orm import Session, sessionmaker

from core.messages import (
    DELIVER_TASK,
    DELIVERIES_QUEUE,
    MAINTENANCE_QUEUE,
    MAINTENANCE_TASK,
    SWEEP_TASK,
    Dispatch,
)
from core.settings import Settings
from tasks.config import create_app
from tasks.publisher import Publisher
from tests.conftest import BIN, REDIS, make_settings, test_env
from tests.factories import accept_event, make_source
from tests.leakcheck import log_file

BROKER_URL = f"{REDIS}/10"
CLAIMS_URL = f"{REDIS}/11"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"

# I/O 1 s < soft 2.5 s < hard 3 s < processing TTL 12 s < visibility 20 s.
FAST: dict[str, Any] = {
    "broker_url": BROKER_URL,
    "redis_url": CLAIMS_URL,
    "handler_io_timeout": 1.0,
    "soft_time_limit": 2.5,
    "hard_time_limit": 3.0,
    "visibility_timeout": 20.0,
    # A stopping worker leaves its wait for the broker within 0.2 s (the default is 1 s).
    "broker_poll_interval": timedelta(seconds=0.2),
    "sweep_interval": timedelta(seconds=1),
    "publish_grace": timedelta(seconds=1),
    "retry_base": timedelta(seconds=0.2),
    "retry_cap": timedelta(seconds=1),
    "max_attempts": 4,
    "max_redeliveries": 3,
    "handler_modules": ["tests.handlers_for_tests"],
    "log_level": "INFO",
}

_counter = itertools.count()

# The pool the test workers run, by default the product's default (Settings.worker_pool);
# WEBHOOKS_TEST_WORKER_POOL=prefork (or gevent) runs the worker tests under another.
DEFAULT_POOL: str = os.environ.get(
    "WEBHOOKS_TEST_WORKER_POOL", str(Settings.model_fields["worker_pool"].default)
)
# Slots of a thread or gevent test worker when a test does not ask for a number.
IO_POOL_SLOTS = 8


def to_env(values: Mapping[str, Any]) -> dict[str, str]:
    """Settings values as WEBHOOKS_* environment variables."""
    env = {}
    for key, value in values.items():
        if isinstance(value, timedelta):
            rendered = f"PT{value.total_seconds()}S"
        elif isinstance(value, list | dict):
            rendered = json.dumps(value)
        else:
            rendered = str(value)
        env[f"WEBHOOKS_{key.upper()}"] = rendered
    return env


def worker_settings(**overrides: Any) -> Settings:
    return make_settings(**{**FAST, **overrides})


def worker_env(**overrides: Any) -> dict[str, str]:
    return test_env(**to_env({**FAST, **overrides}))


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (psutil-free: scan /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may contain spaces.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return sorted(found)


def wait_for(check: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def json_log_lines(path: Path) -> list[dict[str, Any]]:
    """A process's log lines that are JSON objects (its own, not a library's plain lines)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


class Process:
    """A pipeline subprocess whose output goes to the suite's leak-checked log directory."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.log_path = log_file(f"{name}-{next(_counter)}")
        self._out = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT, cwd=cwd
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def json_lines(self) -> list[dict[str, Any]]:
        return json_log_lines(self.log_path)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill_all(self) -> None:
        """kill -9 of the whole worker: the main process and every pool child at once."""
        for pid in [*children(self.pid), self.pid]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_all()
        self._out.close()


class Worker(Process):
    def pool_pids(self) -> list[int]:
        return children(self.pid)

    def wait_ready(self, timeout: float = 120) -> None:
        # Generous: a worker starting beside a loaded suite took over 30 s to be ready.
        # Ready first: a worker given its message before it started may finish it and be
        # killed by the test's own hook (a kill -9 after a commit) within one poll.
        def ready() -> bool:
            if " ready." in self.output():
                return True
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited early:\n{self.output()[-3000:]}")
            return False

        wait_for(ready, timeout=timeout, what=f"worker {self.name} to be ready")


@contextmanager
def running_worker(
    name: str,
    tmp_path: Path,
    *,
    concurrency: int | None = None,
    pool: str | None = None,
    queues: str = f"{DELIVERIES_QUEUE},{MAINTENANCE_QUEUE}",
    extra_env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Iterator[Worker]:
    """A real worker. ``pool``: prefork, threads or gevent (default :data:`DEFAULT_POOL`);
    ``concurrency``: its processes, threads or greenlets (default 1 process, or 8)."""
    pool = pool or DEFAULT_POOL
    if concurrency is None:
        concurrency = 1 if pool == "prefork" else IO_POOL_SLOTS
    overrides = {"worker_pool": pool, "worker_concurrency": concurrency, **overrides}
    cmd = [
        str(BIN / "celery"), "-A", "tasks", "worker",
        "-Q", queues, "-P", pool, "-c", str(concurrency),
        "-n", f"{name}@%h", "--without-mingle", "--without-gossip", "-l", "INFO",
    ]  # fmt: skip
    worker = Worker(
        f"worker-{name}", cmd, {**worker_env(**overrides), **(extra_env or {})}, tmp_path
    )
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@contextmanager
def running_beat(tmp_path: Path, **overrides: Any) -> Iterator[Process]:
    beat = Process(
        "beat",
        [str(BIN / "celery"), "-A", "tasks", "beat", "-l", "INFO"],
        worker_env(**overrides),
        tmp_path,  # beat keeps its schedule file in its working directory
    )
    try:
        yield beat
    finally:
        beat.stop()


class Broker:
    """Publishes like the receiver and beat do, through a Celery app built from Settings."""

    def __init__(self, settings: Settings) -> None:
        self.app: Celery = create_app(settings)

    def publish(self, delivery_id: int, *, countdown: float | None = None) -> None:
        self.app.send_task(DELIVER_TASK, args=[delivery_id], countdown=countdown)

    def sweep(self) -> None:
        self.app.send_task(SWEEP_TASK, queue=MAINTENANCE_QUEUE)

    def maintenance(self) -> None:
        self.app.send_task(MAINTENANCE_TASK, queue=MAINTENANCE_QUEUE)

    def close(self) -> None:
        self.app.close()


def flush_redis(*urls: str) -> None:
    for url in urls or (BROKER_URL, CLAIMS_URL):
        client = redis.Redis.from_url(url)
        try:
            client.flushdb()
        finally:
            client.close()


@pytest.fixture
def clean_worker_state(engine: Engine) -> None:
    """Each test of a module that opts in (``pytest.mark.usefixtures("clean_worker_state")``)
    starts with the handlers' effects table in place and the workers' Redis databases (broker
    and claims) empty: messages and fast-claim keys of earlier tests name the same delivery
    ids. A fixture of this plugin module (registered in ``tests/conftest.py``)."""
    # Imported here: importing it registers the test handlers, which only these modules use.
    from tests.handlers_for_tests import EFFECTS_DDL  # noqa: PLC0415

    with engine.begin() as conn:
        conn.execute(text(EFFECTS_DDL))
    flush_redis()


def new_dispatches(
    sessions: sessionmaker[Session], routes: list[tuple[str, dict[str, str]]], **overrides: Any
) -> list[Dispatch]:
    """One source and event per route: the dispatches the receiver would publish."""
    settings = worker_settings(**overrides)
    out = []
    for handler, options in routes:
        source = make_source(sessions, settings, routes=[{"handler": handler, "options": options}])
        event_id, outcome = accept_event(settings, source)
        out.append(Dispatch(outcome.delivery_ids[0], event_id, source.public_id))
    return out


def publish_one_message(dispatches: list[Dispatch], copies: int = 1, **overrides: Any) -> None:
    """Through the receiver's publisher: deliveries published together are one message."""
    client = redis.Redis.from_url(BROKER_URL)
    before = client.llen(DELIVERIES_QUEUE)
    publisher = Publisher(worker_settings(**overrides))
    try:
        for _ in range(copies):
            publisher.publish_sync(dispatches)
    finally:
        publisher.close()
        publisher.app.close()
    assert client.llen(DELIVERIES_QUEUE) - before == copies  # one message per copy
    client.close()


# -- reading the database -----------------------------------------------------------------


def delivery(engine: Engine, delivery_id: int) -> Row[Any]:
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT * FROM deliveries WHERE id = :id"), {"id": delivery_id}
        ).one()


def attempts(engine: Engine, delivery_id: int) -> list[Row[Any]]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT * FROM attempts WHERE delivery_id = :id ORDER BY started_at, id"),
                {"id": delivery_id},
            )
        )


def effects(engine: Engine, delivery_id: int) -> list[Row[Any]]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT * FROM test_effects WHERE delivery_id = :id ORDER BY id"),
                {"id": delivery_id},
            )
        )


def wait_status(
    engine: Engine,
    delivery_id: int,
    statuses: str | tuple[str, ...],
    *,
    timeout: float = 60,
    tick: Callable[[], None] | None = None,
) -> Row[Any]:
    """Wait until the delivery is in one of ``statuses``; ``tick`` runs on each poll."""
    wanted = (statuses,) if isinstance(statuses, str) else statuses

    def check() -> Row[Any] | None:
        if tick is not None:
            tick()
        row = delivery(engine, delivery_id)
        return row if row.status in wanted else None

    result: Row[Any] = wait_for(
        check, timeout=timeout, what=f"delivery {delivery_id} to be {wanted}", interval=0.25
    )
    return result


def broker_idle(url: str = BROKER_URL, queue: str = DELIVERIES_QUEUE) -> bool:
    """No message waiting in ``queue`` and none delivered but unacknowledged (Redis broker)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.llen(queue)) == 0 and int(client.hlen("unacked")) == 0
    finally:
        client.close()


def retry_logs(worker: Process, delivery_id: int) -> list[dict[str, Any]]:
    return [
        line
        for line in worker.json_lines()
        if line.get("event") == "delivery.retry" and line.get("delivery_id") == delivery_id
    ]


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_metrics(port: int) -> Samples:
    """A real process's ``/metrics`` on ``port``: each sample by (name, sorted labels)."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
