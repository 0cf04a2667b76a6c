"""The receiver's database shell: source lookup (cached) and the one-transaction accept
(the statement itself: :mod:`models.accept`).

Group commit. Concurrent requests in one receiver process share that round trip and that
commit: :meth:`Store.accept` queues the receipt and at most ``accept_concurrency`` batches are
in flight at once, each taking whatever queued up while the previous ones ran (up to
``accept_batch_max``) and running ``webhooks_accept_many(...)`` (migration 0004: for each
element exactly what ``webhooks_accept`` decides, set-based, in one transaction). Alone, a
request runs at once as a batch of one (no added latency); under load, one WAL flush and one
network exchange serve many webhooks. A batch that fails on one element (not a lost
connection) is run again element by element, so one bad request never fails its neighbours.

A database that does not answer. A request waits for the database at most
``WEBHOOKS_DB_ANSWER_TIMEOUT`` (0.9 s), then answers 503 with Retry-After (``Store.accept``): the
statement it waited for goes on in the background (cancelling it would wait for psycopg's
cancel request, which cannot reach a partitioned server either), and a receipt still queued
for a batch is withdrawn, so nothing is written for it. Connections to a server that vanished
without a reset (a partition, a host gone) fail within seconds (:data:`DEAD_PEER`) instead of
after TCP's minutes, freeing the batches stuck on them. After a lost connection every idle
pooled connection is checked at once (a Postgres restart closed them all) and the statement is
run once more on a fresh one, so the first request after the database returns succeeds
instead of each pooled corpse failing one request of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from core import metrics
from core.crypto import SecretBox, source_secret_place
from core.filters import RouteFilter
from core.logs import get_logger
from core.providers import registry
from core.settings import Settings
from core.ttl import TtlOverrides, effective_ttl
from models.accept import (
    ACCEPT_MANY_SQL,
    ACCEPT_SQL,
    RECEIPT_STATES_SQL,
    SENT_ARRIVAL_SQL,
    SENT_AUDIT_SQL,
    NewReceipt,
    Outcome,
    ReceiptState,
    accept_many_params,
    accept_params,
    decide,
    decide_many,
    receipt_states,
    sent_audit_params,
    with_conflict,
)

# A source id that is well formed but not in the database is remembered as missing for this
# long, so a flood of unknown ids costs one query per id per few seconds; a source created
# meanwhile is found once the entry expires (a lookup with ``refresh=True`` skips it).
NEGATIVE_CACHE_SECONDS = 3.0
CACHE_MAX_ENTRIES = 10_000

T = TypeVar("T")
log = get_logger("ingest")

# The receiver's statements take milliseconds: a connection whose sent bytes stay
# unacknowledged for 5 s (tcp_user_timeout, ms), or whose idle peer answers no keepalive
# probe within about 9 s, has lost its server (models/db.py's DEAD_PEER, the workers' and the
# tools', allows 10 s).
DEAD_PEER: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 2,
    "tcp_user_timeout": 5_000,
}

SOURCE_SQL = """
SELECT s.id, s.provider, s.config, s.tolerance_s, s.max_body_bytes,
       s.retry_window_s, s.queue_lag_s, s.clock_skew_s, s.replay_grace_s, s.name, s.active,
       coalesce(array_agg(ss.id ORDER BY ss.created_at DESC)
                FILTER (WHERE ss.id IS NOT NULL), '{}'),
       coalesce(array_agg(ss.ciphertext ORDER BY ss.created_at DESC)
                FILTER (WHERE ss.id IS NOT NULL), '{}'),
       ARRAY(SELECT ARRAY[rt.id::text, rt.events_glob, rt.filter, rt.order_key] FROM routes rt
             WHERE rt.source_id = s.id AND rt.active
               AND (rt.filter IS NOT NULL OR rt.order_key IS NOT NULL)
             ORDER BY rt.id)
FROM sources s
LEFT JOIN source_secrets ss ON ss.source_id = s.id AND ss.revoked_at IS NULL
WHERE s.public_id = %s
GROUP BY s.id
"""

# Failures of the connection or of the transaction as a whole (psycopg files deadlocks and
# cancellations under OperationalError too): every request of the batch answers 503 and the
# provider retries. Whether or not the batch committed, nothing was acknowledged, and a retry
# of a committed event is a duplicate.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    PoolTimeout,
    OSError,
)


def _settle(task: asyncio.Future[Any]) -> None:
    """How a statement that outlived its request ended: a lost or unreachable database is
    one structured line (the request already answered 503); anything else is a bug, logged
    with its traceback."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None:
        return
    if isinstance(exc, (*CONNECTION_ERRORS, psycopg.Error)):
        log.warning("db.late_failure", error_class=type(exc).__name__)
    else:
        log.error("db.late_failure", error_class=type(exc).__name__, exc_info=exc)


@dataclass(frozen=True)
class SourceRecord:
    id: int
    public_id: str
    name: str
    provider: str
    config: dict[str, Any]
    tolerance: timedelta | None
    max_body_bytes: int | None
    ttl: timedelta
    ttl_raised: bool  # the source's TTL did not cover its retry window: ttl is the safe floor
    secrets: tuple[tuple[str, str], ...]  # (secret id, plaintext), newest first
    loaded_at: float
    # False: `webhooks sources disable` (410 Gone); seen within settings.source_cache_ttl.
    active: bool = True
    # Its active routes that hold a filter. A cache older than a change is caught by the
    # accept (``stale``: migration 0027), which the receiver answers by reading them again.
    filters: tuple[RouteFilter, ...] = ()


class Store:
    """Async access for the receiver: a psycopg pool and a small source cache."""

    def __init__(
        self,
        settings: Settings,
        box: SecretBox,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.box = box
        # The negative cache's clock (a test injects one instead of sleeping).
        self._monotonic = monotonic
        self.pool: AsyncConnectionPool[psycopg.AsyncConnection[TupleRow]] = AsyncConnectionPool(
            settings.psycopg_dsn,
            min_size=2,
            max_size=settings.db_pool_size,
            open=False,
            timeout=settings.db_connect_timeout,
            kwargs={
                "autocommit": True,
                "connect_timeout": max(1, int(settings.db_connect_timeout)),
                **DEAD_PEER,
            },
            # No per-checkout health check (a round trip per request): a broken connection
            # fails its request with 503, is discarded by the pool, and the provider retries.
        )
        self._cache: dict[str, SourceRecord] = {}
        self._missing: dict[str, float] = {}  # public id -> when it was found missing
        self._queue: list[tuple[NewReceipt, asyncio.Future[Outcome]]] = []
        self._in_flight = 0
        self._flushers: set[asyncio.Task[None]] = set()
        self._checking: asyncio.Task[None] | None = None  # the pool check after a lost connection

    async def open(self) -> None:
        await self.pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()

    async def source(self, public_id: str, *, refresh: bool = False) -> SourceRecord | None:
        """The source and its active secrets; cached for settings.source_cache_ttl.

        A stale cache can only hold a secret that was revoked since: the accept transaction
        re-checks it, so a revoked secret never writes a row. An id with no source is cached
        as missing for :data:`NEGATIVE_CACHE_SECONDS`.
        """
        cached = self._cache.get(public_id)
        ttl = self.settings.source_cache_ttl.total_seconds()
        if cached is not None and not refresh and time.monotonic() - cached.loaded_at < ttl:
            return cached
        missing_since = self._missing.get(public_id)
        if (
            missing_since is not None
            and not refresh
            and self._monotonic() - missing_since < NEGATIVE_CACHE_SECONDS
        ):
            return None
        row = await self.within(self._again_once(lambda: self._source_row(public_id)))
        if row is None:
            self._cache.pop(public_id, None)
            if len(self._missing) >= CACHE_MAX_ENTRIES:
                self._missing.clear()
            self._missing[public_id] = self._monotonic()
            return None
        self._missing.pop(public_id, None)
        record = self._record(public_id, row)
        if len(self._cache) > CACHE_MAX_ENTRIES:
            self._cache.clear()
        self._cache[public_id] = record
        return record

    async def _source_row(self, public_id: str) -> TupleRow | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute(SOURCE_SQL, (public_id,))
            return await cur.fetchone()

    async def within(self, work: Awaitable[T]) -> T:
        """``work``'s result, or TimeoutError once ``db_answer_timeout`` has passed (the
        request then answers 503): ``work`` itself goes on, shielded, in the background, and
        how it ends is still read (:func:`_settle`): left unread, asyncio would log its
        exception with a traceback when the task is collected."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.settings.db_answer_timeout)
        except TimeoutError:
            task.add_done_callback(_settle)
            raise

    async def _again_once(
        self, statement: Callable[[], Awaitable[T]], wanted: Callable[[], bool] = lambda: True
    ) -> T:
        """``statement``, run once more on a fresh connection if its connection was lost
        (after the idle ones were checked: :meth:`_check_pool`) and ``wanted()`` still (a
        request waits for it: one answered 503 meanwhile must not be recorded after all). A
        retried accept whose first commit did land finds its receipt: a duplicate, never a
        second row."""
        try:
            return await statement()
        except PoolTimeout:
            raise  # no connection to be had: nothing to check
        except (psycopg.OperationalError, psycopg.InterfaceError):
            await self._check_pool()
            if not wanted():
                raise
            return await statement()

    async def _check_pool(self) -> None:
        """Check every idle pooled connection at once, discarding the dead (one check at a
        time per process; a request that arrives meanwhile waits for the running one)."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(self._run_check())
        await asyncio.shield(self._checking)

    async def _run_check(self) -> None:
        try:
            await asyncio.wait_for(self.pool.check(), self.settings.db_connect_timeout)
        except CONNECTION_ERRORS as exc:  # TimeoutError is an OSError
            log.warning("db.pool_check_failed", error_class=type(exc).__name__)

    def forget(self, public_id: str) -> None:
        self._cache.pop(public_id, None)

    def cached_at(self, public_id: str) -> float | None:
        cached = self._cache.get(public_id)
        return None if cached is None else cached.loaded_at

    def _record(self, public_id: str, row: TupleRow) -> SourceRecord:
        (sid, provider, config, tolerance_s, max_body, rw, ql, cs, rg, name, active, ids, cts) = (
            row[:13]
        )
        filters = tuple(RouteFilter(int(r), glob, expr, key) for r, glob, expr, key in row[13])
        if provider in registry.providers():
            ttl = effective_ttl(
                provider, TtlOverrides.from_seconds(rw, ql, cs, rg), self.settings, source_name=name
            )
            total, raised = ttl.total, ttl.raised
        else:  # not installed in this process: the receiver answers 503, the TTL is never used
            total, raised = timedelta(0), False
        return SourceRecord(
            id=int(sid),
            public_id=public_id,
            name=name,
            provider=provider,
            config=dict(config or {}),
            tolerance=None if tolerance_s is None else timedelta(seconds=tolerance_s),
            max_body_bytes=max_body,
            ttl=total,
            ttl_raised=raised,
            secrets=tuple(
                (i, self.box.open(bytes(c), source_secret_place(i)))
                for i, c in zip(ids, cts, strict=True)
            ),
            loaded_at=time.monotonic(),
            active=bool(active),
            filters=filters,
        )

    async def accept(self, receipt: NewReceipt) -> Outcome:
        """Accept one receipt, sharing the round trip and commit with concurrent requests;
        TimeoutError once ``db_answer_timeout`` has passed, the receipt withdrawn if no batch
        has taken it yet."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        entry = (receipt, future)
        self._queue.append(entry)
        if self._in_flight < self.settings.accept_concurrency:
            self._in_flight += 1
            flusher = asyncio.ensure_future(self._flush())
            self._flushers.add(flusher)
            flusher.add_done_callback(self._flushers.discard)
        # One timer, not wait_for and shield (a task and two futures a request, on the
        # receiver's hottest path): the batch that took the receipt finds its future done.
        timer = loop.call_later(self.settings.db_answer_timeout, self._expire, entry)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, entry: tuple[NewReceipt, asyncio.Future[Outcome]]) -> None:
        """The database did not answer in time: the request answers 503. A receipt that no
        batch has taken yet is withdrawn (nothing is written for it); one in a batch may still
        commit, and the sender's retry then finds it: a duplicate."""
        future = entry[1]
        if future.done():
            return
        for i, queued in enumerate(self._queue):
            if queued is entry:
                del self._queue[i]
                break
        future.set_exception(TimeoutError("the database did not answer in time"))

    async def accept_all(self, receipts: Sequence[NewReceipt]) -> list[Outcome]:
        """Accept the events of one request (a batch sender) together: one statement, one
        transaction, so they are all recorded or none is. It does not join the group commit:
        a group that fails is retried element by element, which would split a request."""
        if not receipts:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.db_answer_timeout
        # Past the deadline the request has answered 503: no retry records it after all.
        return await self.within(self._accept_many(list(receipts), lambda: loop.time() < deadline))

    async def _flush(self) -> None:
        try:
            while self._queue:
                size = self.settings.accept_batch_max
                batch, self._queue[:size] = self._queue[:size], []
                await self._run_batch(batch)
        finally:
            self._in_flight -= 1

    async def _run_batch(self, batch: list[tuple[NewReceipt, asyncio.Future[Outcome]]]) -> None:
        receipts = [receipt for receipt, _ in batch]
        metrics.ACCEPT_BATCH.observe(len(batch))
        try:
            outcomes: Sequence[Outcome | BaseException] = await self._accept_many(
                receipts, lambda: not all(future.done() for _, future in batch)
            )
        except CONNECTION_ERRORS as exc:
            outcomes = [exc] * len(batch)
        except psycopg.Error as exc:
            outcomes = [exc] if len(batch) == 1 else await self._one_by_one(receipts)
        except Exception as exc:  # noqa: BLE001  (handed to every waiting request)
            outcomes = [exc] * len(batch)
        for (receipt, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # client gone, or answered 503 at its deadline: the commit stands
                if isinstance(outcome, Outcome) and outcome.status == "accepted":
                    # Recorded although its request was refused: the sender's retry is a
                    # duplicate (200) and the sweeper publishes its deliveries. One line,
                    # so an operator can tell that 200 from a double send.
                    log.warning(
                        "webhook.recorded_after_answer",
                        source_id=receipt.source_id,
                        event_id=receipt.event_id,
                    )
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    async def _one_by_one(self, receipts: list[NewReceipt]) -> list[Outcome | BaseException]:
        """After a failed batch: each element alone, so only the one at fault fails."""
        outcomes: list[Outcome | BaseException] = []
        for receipt in receipts:
            try:
                outcomes.extend(await self._accept_many([receipt]))
            except Exception as exc:  # noqa: BLE001  (handed to that element's request)
                outcomes.append(exc)
        return outcomes

    async def _accept_many(
        self, receipts: list[NewReceipt], wanted: Callable[[], bool] = lambda: True
    ) -> list[Outcome]:
        return await self._again_once(lambda: self._accept_statement(receipts, wanted), wanted)

    async def _accept_statement(
        self, receipts: list[NewReceipt], wanted: Callable[[], bool]
    ) -> list[Outcome]:
        grace = self.settings.publish_grace
        async with self.pool.connection() as conn:
            # The wait for a connection may outlast every request's deadline: those answered
            # 503, so their receipts are not written after all.
            if not wanted():
                raise TimeoutError("every request of this batch has been answered 503")
            if len(receipts) == 1:
                cur = await conn.execute(ACCEPT_SQL, accept_params(receipts[0], grace))
                row = await cur.fetchone()
                return [with_conflict(decide(row), row, receipts[0].digest)]
            cur = await conn.execute(ACCEPT_MANY_SQL, accept_many_params(receipts, grace))
            return decide_many(receipts, await cur.fetchall())

    async def accept_sent(
        self,
        receipts: Sequence[NewReceipt],
        *,
        operator: str,
        source: str,
        provider: str,
    ) -> list[Outcome]:
        """Accept the events of a verified test send (``webhooks send``, its mark checked by
        the receiver): the batch statement in a transaction of its own that records them as
        ``arrived_via = 'test'`` and writes their ``audit_log`` rows, all or nothing. Test
        sends are rare: they never join the group commit, whose transactions are shared with
        providers' events; TimeoutError once ``db_answer_timeout`` has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.db_answer_timeout

        async def run() -> list[Outcome]:
            grace = self.settings.publish_grace
            async with self.pool.connection() as conn, conn.transaction():
                if loop.time() >= deadline:  # answered 503 meanwhile: write nothing
                    raise TimeoutError("the request has been answered 503")
                await conn.execute(SENT_ARRIVAL_SQL)
                cur = await conn.execute(ACCEPT_MANY_SQL, accept_many_params(receipts, grace))
                outcomes = decide_many(receipts, await cur.fetchall())
                audit = sent_audit_params(
                    receipts, outcomes, operator=operator, source=source, provider=provider
                )
                await conn.execute(SENT_AUDIT_SQL, audit)
                return outcomes

        if not receipts:
            return []
        return await self.within(run())

    async def receipt_states(
        self, source_id: int, event_ids: Sequence[str]
    ) -> dict[str, ReceiptState]:
        """Where these recorded events of one source stand (a duplicate's answer): one read,
        TimeoutError once ``db_answer_timeout`` has passed."""

        async def read() -> dict[str, ReceiptState]:
            async with self.pool.connection() as conn:
                params = {"source_id": source_id, "event_ids": list(event_ids)}
                cur = await conn.execute(RECEIPT_STATES_SQL, params)
                return receipt_states(await cur.fetchall())

        return await self.within(read())

    async def ping(self) -> None:
        """One round trip (``/readyz``): after a restart, on a fresh connection once the
        dead pooled ones are found (:meth:`_again_once`), as a request's statement is."""
        await self._again_once(self._ping)

    async def _ping(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("SELECT 1")
