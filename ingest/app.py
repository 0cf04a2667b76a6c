"""The receiver: a thin ASGI app that authenticates, records durably, then acknowledges.

``POST /webhooks/{source_id}``, in this order, and no failing step writes a row:

1. a source id that cannot be ours (not ``src_`` + 20 letters and digits) -> 404 at once;
   unknown source (looked up, or cached as missing for a few seconds) -> 404; disabled -> 410;
   nothing of the body is read for any of them
2. body size limit (per-source override) -> 413, never reading past the limit; a sender
   that goes away mid-body (or is closed by the body timeout, :mod:`ingest.server`) is one
   counted warning line, and nothing is written
3. signature and freshness against the source's active secrets -> 401; a body that would be
   costly to parse before its signature is known (Twilio: too many form parameters) -> 400,
   refused before any signature work; a batch with more events than its provider's cap ->
   413 (Adyen counts its items before checking any HMAC); a test-send mark
   (``Webhooks-Test-Send``, :mod:`core.send_marks`) that does not verify -> 401
4. event id, type and time from the provider's own fields -> 400; more events than the
   provider's cap -> 413
5. one transaction: receipt + deliveries (duplicate -> 200, conflict -> 200, recorded); a
   verified test send's receipts say ``arrived_via = 'test'`` and get an ``audit_log`` row each
6. after the commit, one Celery message per delivery, published by a background thread in
   batches (failure counted; the sweeper publishes what was lost)
7. 202

Postgres unreachable -> 503 with Retry-After: nothing is acknowledged before the commit.
Every 5xx answered is counted per source and minute for `webhooks gaps` (:mod:`models.intake_gaps`).

This port (``WEBHOOKS_PORT``, the one the internet reaches) serves that route, ``/healthz`` and
``/readyz`` only. The admin API and ``/metrics`` (which lists every source's public id) are on
the admin address (``WEBHOOKS_ADMIN_PORT``, :mod:`ingest.admin`), which ``webhooks serve``
runs beside it.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from time import perf_counter
from typing import Any, TypeVar

import orjson
import psycopg
import sqlalchemy.exc
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from core import metrics, send_marks, tracing
from core.clock import Clock, SystemClock, pinned
from core.crypto import SecretBox, SecretDecryptError, SecretMisplaced, SecretUnbound
from core.errors import WebhooksError
from core.filters import FiltersChanged
from core.logs import configure_logging, get_logger
from core.providers import (
    AuthError,
    Batch,
    Challenge,
    EventMeta,
    MalformedEvent,
    TooManyEvents,
    UnsafeBody,
    authenticate,
    extract,
    get_provider,
    registry,
)
from core.settings import Settings, load_settings
from core.ttl import expires_at
from ingest import lifecycle
from ingest.filtering import accept_judged, filtered_field
from ingest.store import SourceRecord, Store
from models.accept import NewReceipt, Outcome
from models.intake_gaps import ErrorCounts
from tasks.publisher import Publisher

log = get_logger("ingest")
T = TypeVar("T")

DB_ERRORS = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    PoolTimeout,
    OSError,
    sqlalchemy.exc.OperationalError,  # from the on-demand partition layout
)
# A request no cached secret verifies reloads the source's secrets (one may have been added),
# but a flood of forged requests may not reload it more often than this.
REFRESH_AFTER_SECONDS = 0.25
# The form of every source id we issue (core.crypto.public_id("src"): 15 random bytes as
# URL-safe base64, 20 characters, with "-" and "_" replaced by "x" and "z"). Anything else is
# answered 404 without a database query and without reading the body.
SOURCE_ID = re.compile(r"src_[A-Za-z0-9]{20}")


class BodyTooLarge(WebhooksError):
    """The body exceeds the source's limit."""


def _json(status: int, data: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers, media_type="application/json")


def _echo(body: bytes, challenge: Challenge) -> Response:
    """A handshake's answer. It echoes text the sender chose (Meta's and Twitch's challenge),
    so browsers are told not to sniff it into something active."""
    return Response(
        body or None,
        challenge.status,
        media_type=challenge.content_type,
        headers={"X-Content-Type-Options": "nosniff"},
    )


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge
    return bytes(body)


class Receiver:
    def __init__(
        self, settings: Settings, clock: Clock, store: Store, publisher: Publisher
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.store = store
        self.publisher = publisher
        self._sync_engine: Any = None
        self.errors = ErrorCounts()  # the 5xx answered, until the heartbeat writes them
        # What verifies `webhooks send`'s mark (derived from WEBHOOKS_SECRET_KEY).
        self._mark_keys = send_marks.mark_keys(settings.secret_key.get_secret_value())

    def _answer(
        self,
        label: str,
        outcome: str,
        status: int,
        data: dict[str, Any],
        event_id: str | None = None,
        headers: dict[str, str] | None = None,
        filtered: tuple[int, ...] = (),
    ) -> Response:
        metrics.REQUESTS.labels(label, outcome).inc()
        log.info(
            "webhook",
            source=label,
            outcome=outcome,
            status=status,
            event_id=event_id,
            **filtered_field(filtered),
        )
        return _json(status, data, headers)

    def _retry_later(self, label: str, outcome: str, error: str, seconds: int) -> Response:
        """503 with Retry-After: nothing was recorded, and the sender keeps the event."""
        self.errors.answered(label, outcome, self.clock.now())
        return self._answer(
            label, outcome, 503, {"error": error}, headers={"Retry-After": str(seconds)}
        )

    def _unavailable(self, label: str) -> Response:
        return self._retry_later(label, "unavailable", "database unavailable", 5)

    def _too_many(self, label: str, exc: TooManyEvents) -> Response:
        # 413, as for a body over the size limit: the request is too large to accept whole,
        # and accepting part of it would answer for events never recorded.
        return self._answer(
            label,
            f"malformed:{exc.reason}",
            413,
            {"error": "too many events in one request", "limit": exc.limit},
        )

    def _provider_missing(self, label: str) -> Response:
        # The source's provider is not installed here (a plug-in removed, or a receiver older
        # than the source): nothing can verify it, but the sender should keep its events and
        # retry, so 503, and a warning someone reads; never 401 or 404.
        log.warning("provider_missing", source=label)
        return self._retry_later(label, "provider_missing", "provider not installed", 60)

    def _undecryptable(self, public_id: str, exc: SecretDecryptError) -> Response:
        # WEBHOOKS_SECRET_KEY does not decrypt this source's secrets (a new .env against an
        # old database), or a secret is sealed for another place (copied there) or not bound
        # yet: the sender must keep the event and retry once it is fixed, so 503 with
        # Retry-After, and one line naming the cause; never a 500.
        if isinstance(exc, SecretMisplaced | SecretUnbound):
            log.error("source.secret_refused", source=public_id, reason=exc.reason, why=str(exc))
        else:
            log.error(
                "source.secret_undecryptable",
                source=public_id,
                fix="set WEBHOOKS_SECRET_KEY to the key this database was written with",
            )
        return self._retry_later(public_id, "secret_undecryptable", "source secret unavailable", 60)

    async def _live_source(self, public_id: str) -> SourceRecord | Response:
        """The enabled source of this id whose provider is installed, or the answer that
        refuses the request; nothing of the body is read for any refusal."""
        if SOURCE_ID.fullmatch(public_id) is None:  # not an id we issue: no query, no body
            return self._answer("unknown", "unknown_source", 404, {"error": "unknown source"})
        try:
            source = await self.store.source(public_id)
        except DB_ERRORS:
            return self._unavailable("unknown")
        except SecretDecryptError as exc:
            return self._undecryptable(public_id, exc)
        if source is None:
            return self._answer("unknown", "unknown_source", 404, {"error": "unknown source"})
        if not source.active:  # nothing is written; what it accepted before still runs
            return self._answer(source.public_id, "disabled", 410, {"error": "source disabled"})
        if source.provider not in registry.providers():
            return self._provider_missing(source.public_id)
        return source

    async def receive(self, request: Request) -> Response:
        started = perf_counter()
        source = await self._live_source(request.path_params["source_id"])
        if isinstance(source, Response):
            return source
        label = source.public_id
        limit = source.max_body_bytes or self.settings.max_body_bytes
        try:
            body = await read_limited(request, limit)
        except ClientDisconnect:
            # The sender went away (or the body timeout closed it) mid-body: nothing to
            # answer and nothing written; one counted line, not a traceback per request.
            metrics.CLIENT_DISCONNECTS.inc()
            log.warning("client_disconnected", source=label)
            return Response(status_code=499)
        except BodyTooLarge:
            return self._answer(
                label, "too_large", 413, {"error": "body too large", "limit": limit}
            )

        now = self.clock.now()
        headers = request.headers
        try:
            secret_id = await self._authenticate(source, headers, body, now)
        except DB_ERRORS:
            return self._unavailable(label)
        except AuthError as exc:
            return self._answer(
                label, f"unauthenticated:{exc.reason}", 401, {"error": "unauthenticated"}
            )
        except TooManyEvents as exc:
            return self._too_many(label, exc)
        except UnsafeBody as exc:  # refused before any signature work
            return self._answer(
                label, f"refused:{exc.reason}", 400, {"error": f"body refused: {exc.reason}"}
            )

        sent: send_marks.TestSend | None = None
        marked = headers.get(send_marks.HEADER)
        if marked is not None:  # `webhooks send`: verified, else refused (core.send_marks)
            try:
                sent = send_marks.verify(
                    self._mark_keys, marked, source=label, body=body, now=int(now.timestamp())
                )
            except send_marks.MarkRefused as exc:
                return self._answer(
                    label, f"unauthenticated:test_mark_{exc.reason}", 401, {"error": str(exc)}
                )

        try:
            meta = extract(source.provider, headers, body, config=source.config)
        except TooManyEvents as exc:
            return self._too_many(label, exc)
        except MalformedEvent as exc:
            return self._answer(
                label, f"malformed:{exc.reason}", 400, {"error": f"malformed event: {exc.reason}"}
            )
        if isinstance(meta, Challenge):
            return await self._challenge(label, source, secret_id, meta)
        if isinstance(meta, Batch):
            return await self._receive_batch(
                label, source, secret_id, meta, body, now, started, sent, headers
            )

        receipt = self._receipt(source, secret_id, meta, body, headers.get("content-type"), now)
        try:
            [outcome] = await self._judged(source, [receipt], headers, sent, one=True)
        except (*DB_ERRORS, FiltersChanged):
            return self._unavailable(label)

        if outcome.status == "revoked":
            self.store.forget(source.public_id)
            return self._answer(label, "unauthenticated:revoked", 401, {"error": "unauthenticated"})
        if _counted_repeat(label, outcome.status):  # a duplicate or a conflict: recorded
            answer: dict[str, Any] = {"status": outcome.status, "event_id": meta.event_id}
            if outcome.status == "duplicate":  # with the recorded outcome (seed 004)
                answer |= (await self._recorded(source, [meta.event_id]))[meta.event_id]
            return self._answer(label, outcome.status, 200, answer, meta.event_id)

        if source.ttl_raised:
            metrics.TTL_RAISED.labels(label).inc()
        # After the commit: hand the ids to the publisher thread; its failures are counted
        # there and the sweeper covers them, so the answer does not wait for the broker.
        dispatches = outcome.dispatches(meta.event_id, source.public_id)
        if tracing.STATE.on:
            dispatches = tracing.accepted(
                dispatches, source.public_id, source.provider, started, headers.get("traceparent")
            )
        self.publisher.submit(label, dispatches)
        metrics.ACCEPT_LATENCY.observe(perf_counter() - started)
        return self._answer(
            label,
            "accepted",
            202,
            {"status": "accepted", "event_id": meta.event_id},
            meta.event_id,
            filtered=outcome.filtered_routes,
        )

    def _receipt(
        self,
        source: SourceRecord,
        secret_id: str,
        meta: EventMeta,
        body: bytes,
        content_type: str | None,
        now: Any,
    ) -> NewReceipt:
        """The receipt of one event: a batch item's own payload, else the body as received
        (form-encoded, JSON, ...) with the request's content type. An event time the
        signature does not cover is stored but never anchors the expiry (the arrival does)."""
        payload = body if meta.payload is None else meta.payload
        anchor = meta.occurred_at if meta.time_signed else None
        return NewReceipt(
            source_id=source.id,
            secret_id=secret_id,
            event_id=meta.event_id,
            event_type=meta.event_type,
            occurred_at=meta.occurred_at,
            expires_at=expires_at(anchor, now, source.ttl),
            # Stamped by the accept statement on the database's clock (a test pins it).
            received_at=pinned(self.clock),
            digest=hashlib.sha256(payload).digest(),
            content_type=content_type if meta.content_type is None else meta.content_type,
            payload=payload,
            ttl=source.ttl,
        )

    async def _challenge(
        self, label: str, source: SourceRecord, secret_id: str, challenge: Challenge
    ) -> Response:
        """A handshake: answered as the provider expects, nothing written. One that depends on
        the secret (Zoom) is computed with the secret that verified this very request."""
        body = challenge.body
        if challenge.sign is not None:
            secret = dict(source.secrets).get(secret_id)
            if secret is None:  # verified by a secret loaded after the cache was filled
                fresh = await self.store.source(source.public_id, refresh=True)
                secret = dict(fresh.secrets).get(secret_id) if fresh is not None else None
            if secret is None:
                return self._answer(
                    label, "unauthenticated:revoked", 401, {"error": "unauthenticated"}
                )
            body = challenge.sign(secret)
        metrics.REQUESTS.labels(label, "challenge").inc()
        return _echo(body, challenge)

    async def _receive_batch(
        self,
        label: str,
        source: SourceRecord,
        secret_id: str,
        batch: Batch,
        body: bytes,
        now: Any,
        started: float,
        sent: send_marks.TestSend | None,
        headers: Any,
    ) -> Response:
        """Several events in one request: one receipt each, deduplicated on its own id, all
        accepted in one transaction (all or nothing); the answer is the provider's own."""
        seen: set[str] = set()
        events = []
        for event in batch.events:
            if event.event_id not in seen:  # the same id twice in one request: stored once
                seen.add(event.event_id)
                events.append(event)
        content_type = None
        receipts = [self._receipt(source, secret_id, e, body, content_type, now) for e in events]
        try:
            outcomes = await self._judged(source, receipts, headers, sent, one=False)
        except (*DB_ERRORS, FiltersChanged):
            return self._unavailable(label)
        if any(o.status == "revoked" for o in outcomes):
            self.store.forget(source.public_id)
            return self._answer(label, "unauthenticated:revoked", 401, {"error": "unauthenticated"})
        dispatches = []
        results: list[dict[str, Any]] = []
        for event, outcome in zip(events, outcomes, strict=True):
            results.append({"event_id": event.event_id, "status": outcome.status})
            if not _counted_repeat(label, outcome.status):
                dispatches += outcome.dispatches(event.event_id, source.public_id)
        duplicates = [r["event_id"] for r in results if r["status"] == "duplicate"]
        if duplicates:  # each with its recorded outcome (seed 004), in one read
            recorded = await self._recorded(source, duplicates)
            for r in results:
                if r["status"] == "duplicate":
                    r.update(recorded[r["event_id"]])
        if source.ttl_raised:
            metrics.TTL_RAISED.labels(label).inc()
        if dispatches:
            if tracing.STATE.on:
                dispatches = tracing.accepted(
                    dispatches, source.public_id, source.provider, started, None
                )
            self.publisher.submit(label, dispatches)
        metrics.ACCEPT_LATENCY.observe(perf_counter() - started)
        accepted = sum(1 for r in results if r["status"] == "accepted")
        outcome_label = "accepted" if accepted else "duplicate"
        metrics.REQUESTS.labels(label, outcome_label).inc()
        log.info(
            "webhook",
            source=label,
            outcome=outcome_label,
            events=len(results),
            accepted=accepted,
            **filtered_field(tuple(r for o in outcomes for r in o.filtered_routes)),
        )
        if batch.answer is not None:
            # The provider's own body (Adyen: [accepted]); 202 when something new was recorded.
            answer = batch.answer
            status = 202 if accepted and answer.status == 200 else answer.status
            return Response(answer.body, status, media_type=answer.content_type)
        return _json(202 if accepted else 200, {"status": outcome_label, "events": results})

    async def _recorded(
        self, source: SourceRecord, event_ids: list[str]
    ) -> dict[str, dict[str, Any]]:
        """What a duplicate's answer adds, by event id: its receipt's recorded outcome
        (:class:`models.accept.ReceiptState`), or ``{"outcome": "unknown"}`` when it cannot be
        read in time (the duplicate is still answered 200: its receipt is durable)."""
        unknown: dict[str, Any] = {"outcome": "unknown"}
        try:
            states = await self.store.receipt_states(source.id, event_ids)
        except (*DB_ERRORS, TimeoutError) as exc:
            log.warning(
                "webhook.duplicate_outcome_unavailable",
                source=source.public_id,
                error=type(exc).__name__,
            )
            states = {}
        return {e: states[e].answer() if e in states else unknown for e in event_ids}

    async def verify_get(self, request: Request) -> Response:
        """``GET /webhooks/{source_id}``: a provider's GET handshake (Meta's ``hub.challenge``),
        405 for providers that have none; nothing is ever written."""
        source = await self._live_source(request.path_params["source_id"])
        if isinstance(source, Response):
            return source
        label = source.public_id
        handshake = get_provider(source.provider).verify_get
        if handshake is None:
            return self._answer(
                label, "method_not_allowed", 405, {"error": "POST only"}, headers={"Allow": "POST"}
            )
        query = dict(request.query_params.items())
        try:
            challenge = handshake(query, source.config)
        except AuthError as exc:
            return self._answer(label, f"unauthenticated:{exc.reason}", 403, {"error": "forbidden"})
        metrics.REQUESTS.labels(label, "challenge").inc()
        return _echo(challenge.body, challenge)

    async def _authenticate(self, source: SourceRecord, headers: Any, body: bytes, now: Any) -> str:
        def verify(record: SourceRecord) -> str:
            return authenticate(
                record.provider,
                headers,
                body,
                record.secrets,
                config=record.config,
                now=now,
                tolerance=record.tolerance,
            )

        try:
            return verify(source)
        except AuthError:
            # A secret added since the cache was filled: reload once, then decide.
            loaded = self.store.cached_at(source.public_id)
            if loaded is None or _age(loaded) < REFRESH_AFTER_SECONDS:
                raise
            fresh = await self.store.source(source.public_id, refresh=True)
            if fresh is None:
                raise
            return verify(fresh)

    async def _judged(
        self,
        source: SourceRecord,
        receipts: list[NewReceipt],
        headers: Any,
        sent: send_marks.TestSend | None,
        *,
        one: bool,
    ) -> list[Outcome]:  # the accept, route filters judged first (ingest.filtering)
        async def run(judged: list[NewReceipt]) -> list[Outcome]:
            if sent is not None:
                return await self._accept_sent(judged, source, sent)
            return [await self._accept(judged[0])] if one else await self._accept_all(judged)

        return await accept_judged(self.store, source, receipts, headers, run)

    async def _accept_all(self, receipts: list[NewReceipt]) -> list[Any]:
        return await self._partitioned(lambda: self.store.accept_all(receipts))

    async def _accept(self, receipt: NewReceipt) -> Any:
        return await self._partitioned(lambda: self.store.accept(receipt))

    async def _accept_sent(
        self, receipts: list[NewReceipt], source: SourceRecord, sent: send_marks.TestSend
    ) -> list[Any]:
        """A verified test send: recorded as ``arrived_via = 'test'`` and audited."""
        outcomes = await self._partitioned(
            lambda: self.store.accept_sent(
                receipts, operator=sent.operator, source=source.public_id, provider=source.provider
            )
        )
        log.info(
            "webhook.test_send",
            source=source.public_id,
            operator=sent.operator,
            events=len(receipts),
            accepted=sum(1 for o in outcomes if o.status == "accepted"),
        )
        return outcomes

    async def _partitioned(self, accept: Callable[[], Awaitable[T]]) -> T:
        try:
            return await accept()
        except psycopg.errors.CheckViolation as exc:
            if "no partition" not in str(exc):
                raise
            # expires_at beyond the partitions laid out so far: create them, then retry once.
            await asyncio.get_running_loop().run_in_executor(None, self._ensure_partitions)
            return await accept()

    def _ensure_partitions(self) -> None:
        # Lazy: SQLAlchemy loads only for this rare call; the receiver's own path is psycopg.
        from models.db import make_engine  # noqa: PLC0415 (SQLAlchemy, see above)
        from models.retention_layout import ensure_partitions  # noqa: PLC0415 (likewise)

        if self._sync_engine is None:
            self._sync_engine = make_engine(self.settings, pool_size=1)
        # Which days are past is the database's call, made under the layout lock.
        ensure_partitions(self._sync_engine, self.settings, pinned(self.clock))

    async def healthz(self, request: Request) -> Response:
        return _json(200, {"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        checks: dict[str, str] = {}
        try:
            await asyncio.wait_for(self.store.ping(), self.settings.db_connect_timeout)
            checks["database"] = "ok"
        except (*DB_ERRORS, TimeoutError):
            checks["database"] = "unreachable"
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.publisher.ping)
            checks["broker"] = "ok"
        except Exception:  # noqa: BLE001  (any broker failure means not ready)
            checks["broker"] = "unreachable"
        # The publisher thread between a death and its restart: accepted events would wait for
        # the sweeper, so this receiver is not ready.
        checks["publisher"] = "ok" if self.publisher.running() else "down"
        ready = all(v == "ok" for v in checks.values())
        return _json(200 if ready else 503, {"status": "ready" if ready else "not ready", **checks})


def _counted_repeat(label: str, status: str) -> bool:
    """Count an accept that recorded nothing new to deliver (a duplicate, or a conflict:
    the same event id with another body); False for any other outcome."""
    counter = {"duplicate": metrics.DUPLICATES, "conflict": metrics.CONFLICTS}.get(status)
    if counter is None:
        return False
    counter.labels(label).inc()
    return True


def _age(loaded_at: float) -> float:
    return time.monotonic() - loaded_at


_HOT_PREFIX = "/webhooks/"


class ReceiverApp(Starlette):
    """Starlette, with the one route every webhook takes (``POST /webhooks/{source_id}``)
    called directly: its routing (a regular expression per route) and its middleware layers
    were a tenth of the receiver's time per request (bench/results_receiver.txt). What they
    did for it is kept: the same path parameter (one segment, as ``{source_id}`` matches), the
    same handler, and an exception still reaches uvicorn, which answers 500 and logs it.
    Everything else (other paths and methods, lifespan) is Starlette's own."""

    def __init__(self, receiver: Receiver, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._receive_webhook = receiver.receive
        self._receiver = receiver

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            source_id = path[len(_HOT_PREFIX) :]
            if path.startswith(_HOT_PREFIX) and source_id and "/" not in source_id:
                scope["app"] = self
                scope["path_params"] = {"source_id": source_id}
                try:
                    response = await self._receive_webhook(Request(scope, receive))
                except Exception:  # a bug: uvicorn answers 500 and logs it; `webhooks gaps`
                    self._receiver.errors.failed(source_id, self._receiver.clock.now())
                    raise
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, clock: Clock | None = None) -> Starlette:
    clock = clock or SystemClock()
    # Every provider, plug-ins included, now: a broken plug-in stops the receiver at start
    # (ProviderPluginError naming it) instead of failing requests.
    registry.providers()
    store = Store(
        settings,
        SecretBox(settings.secret_key.get_secret_value(), legacy=settings.secret_key_legacy),
    )
    publisher = Publisher(settings)
    receiver = Receiver(settings, clock, store, publisher)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lifecycle.report_raised_ttls, settings)
        # This process's TTL inputs in Postgres, refreshed by a thread of its own: compared
        # with the other processes' by maintenance and `webhooks ttl check` (issue 35 item 3).
        fingerprint = await loop.run_in_executor(None, lifecycle.record_fingerprint, settings)
        # That this receiver is up, and the 5xx it answered: `webhooks gaps` (issue 38).
        heartbeat = lifecycle.intake_heartbeat(settings, receiver.errors, clock)
        await store.open()
        tracing.setup("receiver")  # only when an OTLP endpoint is set (core/tracing.py)
        # Everything loaded so far (modules, settings, the providers) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it, and
        # its pauses, which every request in flight waited out, stay short.
        gc.freeze()
        try:
            yield
        finally:
            await store.close()
            publisher.close()
            await loop.run_in_executor(None, fingerprint.stop)
            await loop.run_in_executor(None, heartbeat.stop)
            tracing.shutdown()

    # The public port serves these three and nothing else: the admin API and /metrics are on
    # the admin address (ingest/admin/server.py).
    routes = [
        Route("/webhooks/{source_id}", receiver.receive, methods=["POST"]),
        Route("/webhooks/{source_id}", receiver.verify_get, methods=["GET"]),
        Route("/healthz", receiver.healthz, methods=["GET"]),
        Route("/readyz", receiver.readyz, methods=["GET"]),
    ]
    app = ReceiverApp(receiver, routes=routes, lifespan=lifespan)
    app.state.receiver = receiver
    return app


def app_from_env() -> Starlette:
    """Entry point for ``uvicorn --factory ingest.app:app_from_env`` (settings from env)."""
    settings = load_settings()
    configure_logging(settings.log_level, json=settings.log_json)
    return create_app(settings)
