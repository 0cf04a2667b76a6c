"""The per-process resources a worker's tasks use, built lazily after fork.

Nothing here is needed for correctness across processes: it is a pool of connections and
the handler table. ``tasks.worker.WorkerProcess`` builds one per process on first use; the
``worker_process_init`` signal throws away anything inherited from the parent.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from core.clock import Clock, SystemClock
from core.crypto import SecretBox
from core.settings import Settings
from models.admission import GENERIC_PLANS
from models.db import make_engine, make_sessionmaker
from models.installation import installation_id
from tasks.claims import ClaimStore, make_client
from tasks.handlers.registry import HandlerRegistry, load_registry
from tasks.transforms import TransformRegistry, load_transforms

# A prefork pool process runs one task at a time: one connection for the task, one spare.
WORKER_POOL_SIZE = 2


def engine_pool_size(settings: Settings) -> int:
    """Connections one worker process keeps. Prefork: one task per process, so two, or up
    to ``WEBHOOKS_DB_POOL_SIZE`` when it is set to run batches (WEBHOOKS_DELIVERY_BATCH),
    whose handlers run at once and may each hold one through ``ctx.session`` (tasks.steps.run).
    Threads and gevent: one per slot up to ``WEBHOOKS_DB_POOL_SIZE``; a task holds a
    connection only for its own statements (not while its handler waits on a downstream), so
    ~10 serve 100 slots, and a task that finds them all busy waits for one (SQLAlchemy's
    pool timeout). Postgres' own limit (100 connections by default) is shared by every
    worker and receiver."""
    if settings.worker_pool == "prefork":
        return max(WORKER_POOL_SIZE, min(settings.deliveries_per_message, settings.db_pool_size))
    return max(WORKER_POOL_SIZE, min(settings.worker_slots, settings.db_pool_size))


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    redis: redis.Redis
    claims: ClaimStore
    registry: HandlerRegistry
    box: SecretBox
    clock: Clock
    rng: random.Random
    worker: str
    # The transforms routes may name (tasks.transforms): built-ins, WEBHOOKS_HANDLER_MODULES
    # and the webhooks.transforms entry points.
    transforms: TransformRegistry = field(default_factory=lambda: TransformRegistry({}))
    # State the worker's steps keep for this runtime, by module (tasks/steps/together.py:
    # the combiners its threads share).
    steps: dict[str, object] = field(default_factory=dict)

    def close(self) -> None:
        self.engine.dispose()
        self.redis.close()

    def forget_after_fork(self) -> None:
        """Drop the parent's pooled connections without closing them under the parent."""
        self.engine.dispose(close=False)


def _generic_plans(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
    # The worker's statements are few, prepared, and hit daily partitions: a custom plan
    # re-plans every execution across all partitions, a generic one prunes at run time.
    cparams["options"] = " ".join(filter(None, [cparams.get("options"), GENERIC_PLANS]))


def build_runtime(
    settings: Settings,
    *,
    clock: Clock | None = None,
    rng: random.Random | None = None,
    worker: str | None = None,
) -> Runtime:
    engine = make_engine(settings, pool_size=engine_pool_size(settings), pre_ping=False)
    event.listen(engine, "do_connect", _generic_plans)
    # Once per process: the claim keys' namespace (tasks.claims). A database dropped and
    # recreated under a running worker is caught by the durable rule instead (a pending row
    # re-published twice is claimed through Postgres), until the worker restarts. Postgres
    # unreachable here fails the task, as its first statement would; the next one tries again.
    try:
        installation = installation_id(engine)
    except BaseException:
        engine.dispose()
        raise
    client = make_client(settings.redis_url, settings.redis_socket_timeout)
    return Runtime(
        settings=settings,
        engine=engine,
        sessions=make_sessionmaker(engine),
        redis=client,
        claims=ClaimStore(
            client, installation=installation, processing_ttl=settings.processing_ttl
        ),
        registry=load_registry(settings.handler_modules),
        box=SecretBox(settings.secret_key.get_secret_value(), legacy=settings.secret_key_legacy),
        clock=clock or SystemClock(),
        # A seed makes retry delays reproducible (tests); None draws from the OS.
        rng=rng or random.Random(settings.retry_seed),  # noqa: S311 (jitter, not crypto)
        worker=worker or f"{socket.gethostname()}:{os.getpid()}",
        transforms=load_transforms(settings.handler_modules),
    )
