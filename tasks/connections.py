"""The worker's database connections: which errors mean the database went away
(:data:`CONNECTION_ERRORS`), statements in autocommit on a pooled connection
(:func:`on_connection`), recording an outcome that has already happened, retried through
lost connections and never dropped (:func:`record`), and what a periodic task does when the
database is unreachable (:func:`periodic_runtime`, :func:`periodic_failed`).

Once a handler has returned, its effect exists (a downstream called, a message sent). If the
statement that records it then fails because the database connection died (Postgres
restarted, a connection terminated, a failover), giving the delivery back would call the
downstream a second time for an effect it already made. So the worker keeps trying to record
the outcome, on a fresh connection each time, for ``WEBHOOKS_RECORD_RETRY_SECONDS`` (longer
than a Postgres restart), and only then leaves the delivery to its lease, as after a crash.
The same holds for a failure's record (retry later, dead): it is retried, never dropped.

Retrying is safe because every recording statement is guarded by the delivery's status, its
attempt number (the fencing token) and its key generation: a statement that did commit before
its answer was lost matches no row the second time, and one that lost its lease to another
attempt matches none either.

After a connection error every connection pooled before it is replaced at its next checkout
(:func:`discard_pooled`): a Postgres restart kills them all, and the next statements must not
each discover that on their own. This is the one mechanism for every statement of the
worker: the claim's stale-connection guard (:mod:`tasks.steps.claim`) uses it too.

Each failed try is one structured warning line with the error's class; no traceback (a lost
connection is an expected condition, not a bug).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import psycopg
import sqlalchemy.exc
from psycopg_pool import PoolTimeout
from sqlalchemy import Engine

from core.errors import WebhooksError
from core.logs import get_logger
from core.metrics import JOB_LAST_SUCCESS, RECORD_RETRIES
from models.db import DatabaseUnavailable
from tasks.runtime import Runtime

log = get_logger(__name__)

T = TypeVar("T")

# The errors of a database that went away or cannot be reached; all else is a bug or a
# guard's verdict and is raised as it is.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    PoolTimeout,
)
# Waits between tries: short first (a terminated connection is replaced at once), then up
# to this long (a restarting Postgres takes seconds).
FIRST_WAIT = 0.05
LONGEST_WAIT = 1.0


class Unrecorded(WebhooksError):
    """The outcome could not be recorded within the retry time: the delivery keeps its lease
    and is taken over when the lease runs out (a crash, for the pipeline)."""

    reason = "database_unavailable"


def is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, CONNECTION_ERRORS)


def discard_pooled(engine: Engine) -> None:
    """Every connection pooled until now is replaced at its next checkout (those checked out
    are replaced when they come back). SQLAlchemy does the same on a disconnect it sees in its
    own statements; the worker's statements run on the driver's connection, so it says so
    itself."""
    engine.pool._invalidate(cast(Any, None))  # noqa: SLF001 (no public spelling)


@contextmanager
def autocommit(raw: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """Statements on ``raw`` each commit on their own: one round trip each, no BEGIN/COMMIT.
    Only between transactions: the session never sees the connection in this mode."""
    raw.autocommit = True
    try:
        yield raw
    finally:
        if not raw.closed:
            raw.autocommit = False


def on_connection(engine: Engine, statement: Callable[[psycopg.Connection[Any]], T]) -> T:
    """Run ``statement`` on a pooled connection in autocommit. A connection that failed is
    invalidated, not handed back to the pool (whose reset would fail on it and log that)."""
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        try:
            with autocommit(raw):
                return statement(raw)
        except CONNECTION_ERRORS:
            conn.invalidate()
            raise


def record(
    engine: Engine,
    action: str,
    delivery_ids: Sequence[int],
    attempt: Callable[[], T],
    *,
    within: float,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run ``attempt`` (a guarded statement that opens its own connection) until it returns,
    retrying on connection errors for ``within`` seconds; :class:`Unrecorded` after that.
    Any other error is raised at once."""
    deadline = time.monotonic() + within
    wait = FIRST_WAIT
    tries = 0
    while True:
        try:
            return attempt()
        except CONNECTION_ERRORS as exc:
            tries += 1
            discard_pooled(engine)
            RECORD_RETRIES.labels(action=action).inc()
            left = deadline - time.monotonic()
            fields = {
                "action": action,
                "delivery_ids": list(delivery_ids),
                "error_class": type(exc).__name__,
                "tries": tries,
            }
            if left <= 0:
                log.warning("delivery.record_abandoned", **fields)
                raise Unrecorded(action) from None
            log.warning("delivery.record_retry", **fields)
            sleep(min(wait, left))
            wait = min(wait * 2, LONGEST_WAIT)


def periodic_runtime(runtime: Callable[[], Runtime], failed: str) -> Runtime:
    """This process's runtime for a periodic task (sweep, maintenance, reconcile); when
    Postgres cannot be reached to build it (a worker that started during an outage has no
    runtime until its first statement succeeds), :func:`periodic_failed` raised."""
    try:
        return runtime()
    except CONNECTION_ERRORS as exc:
        raise periodic_failed(failed, exc) from None


def periodic_done(rt: Runtime, job: str) -> None:
    """A periodic task's run finished without an error: ``job``'s last-success gauge, the
    runtime's clock (deploy/alerts.yml alerts when it falls two periods behind)."""
    JOB_LAST_SUCCESS.labels(job).set(rt.clock.now().timestamp())


def periodic_failed(failed: str, exc: BaseException) -> DatabaseUnavailable:
    """What a periodic task raises when its database is unreachable: one warning line,
    ``failed`` with the error's class, never a traceback; then the run ends as FAILURE in
    Flower with ``DatabaseUnavailable`` (declared in the task's ``throws``: Celery logs it as
    expected, without a traceback), not as a SUCCESS that did nothing. The next run retries."""
    name = type(exc).__name__
    get_logger("tasks").warning(failed, error_class=name)
    return DatabaseUnavailable(f"database unavailable ({name}); the next run retries")
