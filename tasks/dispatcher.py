"""The dispatcher: admits waiting deliveries round-robin across routes (models/admission.py).

Each worker runs one in its main process, in a thread started when the worker is ready
(``WEBHOOKS_DISPATCHER=false`` turns it off). Every ``WEBHOOKS_DISPATCH_INTERVAL`` (50 ms),
sooner when a rate-limited route's next slot comes first or a finished task wakes it (wakes
closer than :data:`MIN_ROUND_GAP` share a round), it

1. at most every :data:`RECONCILE_INTERVAL` (0.5 s), frees the in-flight slots of finished
   deliveries that their tasks did not free (:func:`models.admission.reconcile`: Postgres
   decides what is finished), re-learning the sets after a Redis flush;
2. moves the retries that are due (Postgres' clock) to their routes' waiting sets;
3. admits waiting deliveries of the routes that are not held, round-robin (A, B, C, A, B,
   C), oldest first within a route, each route within its budget and rate, in one Lua
   script: two dispatchers on two hosts never admit one delivery twice. Work-conserving:
   while a route on the default budget is the only one with deliveries waiting, it may use
   the idle workers, up to :data:`models.admission.ELASTIC_FACTOR` times the live workers'
   slots (each dispatcher counts its worker's slots in Redis every
   :data:`HEARTBEAT_INTERVAL`); a budget set by hand (``--max-in-flight``) is never exceeded;
4. publishes them (messages of up to ``WEBHOOKS_DELIVERY_BATCH`` ids, as the receiver does).

Killed at any point it loses nothing: a delivery is a pending row before and after. Admitted
and not published (a kill between 3 and 4), it is freed by the next reconcile after the
publish grace and the sweeper offers it again; a failed publish puts it back to waiting.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from core import metrics
from core.logs import get_logger
from core.messages import Dispatch
from core.settings import Settings
from models import admission
from models.admission import Admission, RouteLimits, connect_generic
from tasks.claims import make_client
from tasks.publisher import Publisher

log = get_logger(__name__)

Publish = Callable[[Sequence[Dispatch]], None]
# Seconds a failing dispatcher waits before it tries again (one line per failure).
FAILURE_DELAY = 1.0
# Seconds at least between two reconciles (step 1): a finished task frees its own slots at
# once (tasks.deliver.release_slots); the reconcile is for what that misses (a crash, a lost
# message, a flush), and its statement costs the more the more deliveries are in flight.
RECONCILE_INTERVAL = 0.5
# Seconds between a dispatcher's counts of its worker's slots among the live ones.
HEARTBEAT_INTERVAL = 1.0
# Seconds at least between the starts of two rounds woken by finished tasks: every finished
# task wakes the dispatcher, and the wakes that come closer than this are served by one
# round (a round costs a few Redis and Postgres round trips; one round per finished task cost
# a quarter more CPU per delivery, bench_forward).
MIN_ROUND_GAP = 0.02
# Set by a task of this process that freed admission slots (tasks.deliver.release_slots): the
# dispatcher runs its next round now rather than at the end of its interval.
_WAKE = threading.Event()


# Slots freed by this process's tasks, released by its own dispatcher in its next round (one
# Redis pipeline for all of them, at most MIN_ROUND_GAP later) rather than one round trip per
# task: only while a dispatcher runs in this very process (threads and gevent pools; a prefork
# child runs none, and releases its own). Lost with the process: the reconcile frees them.
_RELEASES: dict[int, list[int]] = {}
_RELEASES_LOCK = threading.Lock()
_RUNNING_IN: int | None = None  # the pid whose dispatcher thread runs


def wake() -> None:
    """Ask this process's dispatcher (if it runs one) for a round now."""
    _WAKE.set()


def defer_release(done: dict[int, list[int]]) -> bool:
    """Hand finished deliveries' slots (route -> ids) to this process's dispatcher and wake it.
    False when no dispatcher runs in this process: the caller releases them itself."""
    if os.getpid() != _RUNNING_IN:
        return False
    with _RELEASES_LOCK:
        for route, ids in done.items():
            _RELEASES.setdefault(route, []).extend(ids)
    _WAKE.set()
    return True


def _take_releases() -> dict[int, list[int]]:
    with _RELEASES_LOCK:
        taken = dict(_RELEASES)
        _RELEASES.clear()
    return taken


class Dispatcher:
    """One dispatcher: its own Postgres connection (autocommit) and Redis client."""

    def __init__(self, settings: Settings, publish: Publish) -> None:
        self.settings = settings
        self.publish = publish
        self.admission = Admission(make_client(settings.redis_url, settings.redis_socket_timeout))
        self._conn: psycopg.Connection[Any] | None = None
        self._reconciled = 0.0
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._beat = float("-inf")
        self._elastic = 0

    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect_generic(self.settings.psycopg_dsn)
        return self._conn

    def once(self) -> float:
        """One round; returns the seconds to wait before the next."""
        interval = self.settings.dispatch_interval.total_seconds()
        # The finished tasks' slots freed, the retries due and the routes waiting read, in
        # one round trip (a failure here fails the round; the reconcile frees them later).
        due, routes = self.admission.start_round(_take_releases())
        conn = self.conn()
        if time.monotonic() - self._reconciled >= max(interval, RECONCILE_INTERVAL):
            admission.reconcile(conn, self.admission, grace=self.settings.publish_grace)
            self._reconciled = time.monotonic()
        if due and admission.promote_due(conn, self.admission, due):
            routes = self.admission.waiting_routes()  # with the routes of those promoted
        if not routes:
            return interval
        limits = admission.limits_of(conn, routes, self.settings.route_max_in_flight)
        drained = self.admission.drain(limits.values(), elastic=self.elastic())
        if drained.admitted:
            labels = admission.labels_of(conn, [i for _, i in drained.admitted])
            self._publish(drained.admitted, limits, labels)
        if len(drained.admitted) >= admission.DRAIN_LIMIT:
            return 0.0
        if drained.wake_ms:
            until = (drained.wake_ms - self.admission.now_ms()) / 1000.0
            return max(0.001, min(interval, until))
        return interval

    def elastic(self) -> int:
        """The in-flight budget a lone route on the default budget may use: the live
        workers' slots (this one's counted now and then) times the elastic factor."""
        if time.monotonic() - self._beat >= HEARTBEAT_INTERVAL:
            live = self.admission.heartbeat(self._name, self.settings.worker_slots)
            self._elastic = live * admission.ELASTIC_FACTOR
            self._beat = time.monotonic()
        return self._elastic

    def _publish(
        self,
        pairs: list[tuple[int, int]],
        limits: dict[int, RouteLimits],
        labels: dict[int, tuple[str, str]],
    ) -> None:
        try:
            self.publish([Dispatch(i, *labels.get(i, (None, None))) for _, i in pairs])
        except Exception as exc:  # noqa: BLE001 (waiting again: the next round retries)
            self.admission.requeue(pairs)
            log.warning("dispatch.publish_failed", deliveries=len(pairs), error=type(exc).__name__)
            return
        metrics.ADMISSIONS.labels("drained").inc(len(pairs))
        log.debug("dispatch.admitted", deliveries=len(pairs), routes=len(limits))

    def run(self, stop: threading.Event) -> None:
        """Rounds until ``stop``; a failing round (Postgres or Redis away) is logged and
        tried again after :data:`FAILURE_DELAY`."""
        global _RUNNING_IN  # noqa: PLW0603
        _RUNNING_IN = os.getpid()
        try:
            self._rounds(stop)
        finally:
            _RUNNING_IN = None
            released = _take_releases()
            if released:
                with contextlib.suppress(Exception):  # the reconcile frees them later
                    self.admission.release(released)
            self.close()

    def _rounds(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                wait = self.once()
            except Exception as exc:  # noqa: BLE001 (see the docstring)
                log.warning("dispatch.failed", error_class=type(exc).__name__)
                self.close()
                wait = FAILURE_DELAY
            if wait and _WAKE.wait(wait):
                # Woken by a finished task: the next round waits for the gap, never past the
                # instant this round asked for (a rate-limited route's next slot).
                rest = min(MIN_ROUND_GAP, wait) - (time.monotonic() - started)
                if rest > 0:
                    stop.wait(rest)
            _WAKE.clear()
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


def start(settings: Settings) -> threading.Event:
    """The worker's dispatcher thread (daemon); set the returned event to stop it (it stops
    within one dispatch interval)."""
    publisher = Publisher(settings)
    dispatcher = Dispatcher(settings, publisher.publish_sync)
    stop = threading.Event()
    threading.Thread(target=dispatcher.run, args=(stop,), name="dispatcher", daemon=True).start()
    log.info("worker.dispatcher", interval=settings.dispatch_interval.total_seconds())
    return stop
