"""Admission in front of Celery: a delivery is published to the broker only while its route is
under its in-flight budget and its rate limit (issue 23, items 1 and 2).

Why admission and not per-route queues: the broker's one queue is first in, first out, so a
6,000-event burst on one route puts every other route's events behind it. Admission keeps at
most ``max_in_flight`` of a route's deliveries in the broker and the workers at once; the
rest wait as pending rows (Postgres stays the record) and in a per-route waiting set in
Redis, from which the dispatcher (:mod:`tasks.dispatcher`) admits them round-robin across
routes (A, B, C, A, B, C), oldest first within a route. Per-route queues would need a Celery
queue per route on every worker, declared ahead: routes come and go at run time.

State in Redis (``adm:`` keys, one Lua script per call, so a decision is atomic across every
receiver, worker and host):

- ``adm:f:<route>``: the route's in-flight set, delivery id -> admission time (ms). ``ZADD``
  at admission; a member leaves when :func:`reconcile` finds its row finished (succeeded,
  retrying, dead), its lease expired (the worker died), or it pending past the publish grace
  after admission (the message was lost; the sweeper publishes it again, through admission).
  So a lost finish heals itself within one dispatch interval: Postgres says what is done.
- ``adm:w:<route>``: the route's waiting set, delivery id -> id (ids grow with time: oldest
  first). ``adm:routes`` / ``adm:waiting``: the routes that have members in either.
- ``adm:d``: retries scheduled by the workers, delivery id -> due (ms, Redis clock). A failed
  attempt's retry is not a countdown message to the broker (that would escape the route's
  budget and rate): the dispatcher moves it to its route's waiting set once Postgres says
  it is due (the database clock decides: ``status = 'retrying' AND next_attempt_at <=
  now()``), and admits it like any other. Waiting there is no attempt. Lost with a flush:
  the sweeper picks retrying rows due more than the grace ago, as before admission.
- ``adm:r:<route>``: the rate limiter's theoretical arrival time (GCRA without burst: the
  admissions of a route are at least ``period / count`` apart, so no one-second window holds
  more than the rate).
- ``adm:p:<route>``: the same for the calls themselves (:meth:`Admission.pace`, taken by the
  worker right before a rate-limited route's handler). Admissions are spaced, but the broker,
  the claim and a busy worker between an admission and its call move calls closer together
  (22 calls in one second at 20/s, seen under load): the downstream sees the calls' spacing.
- ``adm:g:<route>``: when the route's last call passed the gate (:meth:`Admission.gate`, ms,
  Redis clock). A reservation is taken before a sleep, and a worker can wake late (a busy
  host, its reply in flight) while the next one wakes on time: the gate, taken right before
  the call, holds the later one back until the interval since the last pass is over.

Admitting an id that is already in flight answers "duplicate" (published once, whoever
admitted it first): a receiver and a dispatcher, or two dispatchers, never admit one
delivery twice while Redis holds the set.

Fail safe: a flushed Redis loses the sets. The waiting rows are pending in Postgres; the
sweeper picks them after the publish grace and offers them to admission again (only the
sweeper: its pick moves the row's next_attempt_at and counts ``republished``, which the
worker's claim relies on to see through a stale fast-claim key, and its grace keeps a row
whose message is still in the broker from being published twice). The in-flight sets are
re-learned from Postgres (the processing rows under a live lease) by the next
:func:`reconcile` (the ``adm:epoch`` key tells a flush); deliveries published and not yet
claimed at the flush are the only ones not counted: the budget is exceeded by those, for the
one request each makes. Redis unreachable: admission fails open (publish, as before
admission existed), counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import redis

from core import metrics
from core.errors import WebhooksError
from core.messages import Dispatch
from models import admission_lua as lua
from models.views import (
    SPACING,
    Rate,
)

# Defined in models.views (no database library: the CLI's fast reads build them too),
# importable from here, where they were first defined.
__all__ = [
    "SPACING",
    "Rate",
]


PREFIX = "adm:"
# Waiting deliveries one dispatch admits at most (it runs again at once when it hit this).
DRAIN_LIMIT = 500
# Work-conserving default budget: a route on the default budget that is the only route with
# deliveries waiting may have up to this many times the live workers' slots in flight (the
# broker holds at most one more round of them ahead of a newcomer's delivery).
ELASTIC_FACTOR = 2
# A dispatcher's slots count in the live total for this long after its last heartbeat (ms).
SLOTS_TTL_MS = 5000

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$", re.IGNORECASE)
_PERIODS = {"s": 1, "m": 60, "h": 3600}


class LimitError(WebhooksError, ValueError):
    """A limit that cannot be set (its text says which and why)."""


def parse_rate(text: str) -> Rate | None:
    """``50/s``, ``3000/m``, ``10000/h`` or ``none``; raises LimitError otherwise."""
    if text.strip().lower() == "none":
        return None
    found = _RATE.match(text)
    if found is None:
        raise LimitError(f"rate limit {text!r}: expected N/s, N/m, N/h or none (e.g. 50/s)")
    count = int(found.group(1))
    if not 1 <= count <= 1_000_000:
        raise LimitError(f"rate limit {text!r}: the count must be 1 to 1000000")
    return Rate(count, _PERIODS[found.group(2)[0].lower()])


def parse_max_in_flight(text: str) -> int | None:
    """A positive count, or ``none`` (the default budget); raises LimitError otherwise."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise LimitError(f"max in flight {text!r}: expected a whole number or none") from None
    if not 1 <= value <= 100_000:
        raise LimitError(f"max in flight {text!r}: must be 1 to 100000")
    return value


# For connections whose statements look rows up by id across every daily partition, where
# nothing can be pruned while planning (``d.id = ANY(...)``: admission's routes and labels, the
# worker's probes): psycopg prepares a statement after its fifth run, and Postgres then keeps
# planning it anew for every execution, across all partitions (about 1 ms at 14 days, more
# than the statement itself: bench/results_receiver.txt). A generic plan is made once and
# still prunes at run time.
GENERIC_PLANS = "-c plan_cache_mode=force_generic_plan"


def connect_generic(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection with :data:`GENERIC_PLANS` (the dispatcher's and the
    receiver's admission connections; the worker's engine sets the same option)."""
    return psycopg.connect(dsn, autocommit=True, connect_timeout=5, options=GENERIC_PLANS)


@dataclass(frozen=True)
class RouteLimits:
    """What admission needs of a route: its budget, its rate, whether it is held (paused or
    its breaker not closed: the claim would not take its deliveries, so none is admitted)."""

    route_id: int
    max_in_flight: int
    rate: Rate | None
    held: bool
    # On the default budget (no max_in_flight of its own): the dispatcher may let it use idle
    # workers beyond the budget while no other route has deliveries waiting (Admission.drain).
    # A budget set by hand is the downstream's protection and is never exceeded.
    elastic: bool = False

    @property
    def interval_ms(self) -> float:
        return self.rate.interval_ms if self.rate else 0


# A route's limits from its row (NULL budget: the default one).
_LIMITS_COLUMNS = """r.id, r.max_in_flight, r.rate_count, r.rate_period_s,
       (r.paused_at IS NOT NULL OR r.breaker_state <> 'closed')"""


def limits_from_row(row: Sequence[Any], default_budget: int) -> RouteLimits:
    """A route's limits from the columns of ``_LIMITS_COLUMNS`` (held may be 0/1: the accept
    functions return them as one bigint array, migration 0018)."""
    rate = None if row[2] is None else Rate(int(row[2]), int(row[3]))
    budget = default_budget if row[1] is None else int(row[1])
    return RouteLimits(int(row[0]), budget, rate, bool(row[4]), elastic=row[1] is None)


def routes_of(
    conn: psycopg.Connection[Any], ids: Sequence[int], default_budget: int
) -> dict[int, RouteLimits]:
    """Each delivery's route and its limits (one statement; deliveries whose route is gone
    are missing: the caller publishes them, and the worker makes them dead letters)."""
    rows = conn.execute(
        f"SELECT d.id, {_LIMITS_COLUMNS} FROM deliveries d JOIN routes r ON r.id = d.route_id"  # noqa: S608
        " WHERE d.id = ANY(%(ids)s::bigint[])",
        {"ids": list(ids)},
    ).fetchall()
    return {int(row[0]): limits_from_row(row[1:], default_budget) for row in rows}


def labels_of(conn: psycopg.Connection[Any], ids: Sequence[int]) -> dict[int, tuple[str, str]]:
    """Each delivery's event id and source public id, for the message's keyword arguments
    (what Flower shows and searches), as every other publisher sends them. One statement;
    a delivery whose receipt or source is gone is missing (published with its id alone)."""
    rows = conn.execute(
        "SELECT d.id, r.event_id, s.public_id FROM deliveries d"
        " JOIN receipts r ON r.id = d.receipt_id AND r.expires_at = d.expires_at"
        " JOIN sources s ON s.id = d.source_id"
        " WHERE d.id = ANY(%(ids)s::bigint[])",
        {"ids": list(ids)},
    ).fetchall()
    return {int(row[0]): (str(row[1]), str(row[2])) for row in rows}


def limits_of(
    conn: psycopg.Connection[Any], route_ids: Iterable[int], default_budget: int
) -> dict[int, RouteLimits]:
    rows = conn.execute(
        f"SELECT {_LIMITS_COLUMNS} FROM routes r WHERE r.id = ANY(%(ids)s::bigint[])",  # noqa: S608
        {"ids": list(route_ids)},
    ).fetchall()
    return {int(row[0]): limits_from_row(row, default_budget) for row in rows}


@dataclass(frozen=True)
class Offer:
    """The receiver's or the sweeper's deliveries, sorted by what admission decided."""

    admitted: list[int]
    duplicate: list[int]
    waiting: list[int]
    unknown: list[int]  # no route found: published as before (the worker decides)


class Admission:
    """The Redis side of admission (one client; the clock is Redis' own ``TIME``, shared by
    every host: the scripts read it themselves)."""

    def __init__(self, client: redis.Redis, *, prefix: str = PREFIX) -> None:
        self.client = client
        self.prefix = prefix
        self._admit = client.register_script(lua.ADMIT)
        self._drain = client.register_script(lua.DRAIN)
        self._round = client.register_script(lua.ROUND)
        self._pace = client.register_script(lua.PACE)
        self._gate = client.register_script(lua.GATE)
        self._hand_over = client.register_script(lua.HAND_OVER)

    def now_ms(self) -> float:
        seconds, micros = self.client.time()
        return seconds * 1000.0 + micros / 1000.0

    def pace(self, route_id: int, rate: Rate) -> float:
        """Reserve the route's next call: the seconds to wait before making it, so that the
        route's calls are at least ``rate.interval_ms`` apart on Redis' clock, across every
        worker and host (one round trip)."""
        answer = self._pace(keys=[], args=[f"{self.prefix}p:{route_id}", rate.interval_ms])
        return max(0.0, float(answer)) / 1000.0

    def gate(self, route_id: int, rate: Rate) -> float:
        """Pass the route's gate right before a call: 0 when the route's last pass is at least
        ``rate.interval_ms`` ago (this pass is recorded), else the seconds left to wait."""
        answer = self._gate(keys=[], args=[f"{self.prefix}g:{route_id}", rate.interval_ms])
        return max(0.0, float(answer)) / 1000.0

    def offer(self, ids: Sequence[int], routes: dict[int, RouteLimits]) -> Offer:
        """One round trip for the whole batch: admit what fits per route, in order."""
        known = [i for i in ids if i in routes]
        unknown = [i for i in ids if i not in routes]
        if not known:
            return Offer([], [], [], unknown)
        args: list[Any] = [self.prefix]  # the script reads Redis' TIME itself
        for i in known:
            limits = routes[i]
            args += [
                limits.route_id,
                i,
                limits.max_in_flight,
                limits.interval_ms,
                1 if limits.held else 0,
            ]
        answers = self._admit(args=args)
        out: dict[bytes, list[int]] = {b"a": [], b"d": [], b"w": []}
        for i, answer in zip(known, answers, strict=True):
            out[answer if isinstance(answer, bytes) else str(answer).encode()].append(i)
        return Offer(out[b"a"], out[b"d"], out[b"w"], unknown)

    def hand_over(self, lanes: Sequence[tuple[int, int, Sequence[int]]]) -> list[bool]:
        """Per lane (route, next head, its predecessors in this message): the predecessors
        leave the route's in-flight set and, if one of them was in it, the head takes its
        place, in one step (True); False where none was (the head is not counted: published
        as before admission knew of lanes). One round trip for them all."""
        if not lanes:
            return []
        args: list[Any] = [self.prefix]
        for route, head, before in lanes:
            args += [route, head, len(before), *before]
        return [answer in (b"a", "a") for answer in self._hand_over(args=args)]

    def start_round(
        self, released: dict[int, list[int]], *, most: int = DRAIN_LIMIT
    ) -> tuple[list[int], list[int]]:
        """A dispatcher round's first round trip: :meth:`release` these finished deliveries,
        then answer :meth:`scheduled_due` (at most ``most``) and :meth:`waiting_routes`."""
        args: list[Any] = [self.prefix, most]
        for route, ids in released.items():
            if ids:
                args += [route, len(ids), *ids]
        due, routes = self._round(args=args)
        return [int(i) for i in due], sorted(int(r) for r in routes)

    def waiting_routes(self) -> list[int]:
        return sorted(int(r) for r in self.client.smembers(self.prefix + "waiting"))

    def drain(
        self, limits: Iterable[RouteLimits], *, most: int = DRAIN_LIMIT, elastic: int = 0
    ) -> Drained:
        """Admit waiting deliveries round-robin across these routes (held ones skipped).
        ``elastic``: the in-flight budget a lone route on the default budget may use
        (:meth:`live_slots` times :data:`ELASTIC_FACTOR`; 0: none)."""
        args: list[Any] = [self.prefix, most, elastic]
        for route in limits:
            if not route.held:
                args += [
                    route.route_id,
                    route.max_in_flight,
                    route.interval_ms,
                    1 if route.elastic else 0,
                ]
        if len(args) == 3:
            return Drained([], 0.0)
        answer = self._drain(args=args)
        pairs = [(int(answer[i]), int(answer[i + 1])) for i in range(0, len(answer) - 1, 2)]
        return Drained(pairs, float(answer[-1]))

    def heartbeat(self, worker: str, slots: int) -> int:
        """Count ``worker``'s slots among the live ones for :data:`SLOTS_TTL_MS`; returns the
        live workers' slots in total (every dispatcher's last heartbeat within the TTL)."""
        now = self.now_ms()
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.prefix + "seen", {worker: now + SLOTS_TTL_MS})
        pipe.hset(self.prefix + "slots", worker, slots)
        pipe.zrangebyscore(self.prefix + "seen", now, "+inf")
        pipe.hgetall(self.prefix + "slots")
        _, _, live, counts = pipe.execute()
        gone = set(counts) - set(live)
        if gone:  # dispatchers silent past the TTL: forgotten
            pipe.zrem(self.prefix + "seen", *gone)
            pipe.hdel(self.prefix + "slots", *gone)
            pipe.execute()
        return sum(int(counts[w]) for w in live if w in counts)

    def in_flight(self) -> dict[int, dict[int, float]]:
        """Every route's in-flight set: route -> {delivery id: admitted at (ms)}."""
        routes = sorted(int(r) for r in self.client.smembers(self.prefix + "routes"))
        pipe = self.client.pipeline(transaction=False)
        for route in routes:
            pipe.zrange(f"{self.prefix}f:{route}", 0, -1, withscores=True)
        found = pipe.execute() if routes else []
        return {
            route: {int(m): float(s) for m, s in members}
            for route, members in zip(routes, found, strict=True)
        }

    def release(self, done: dict[int, list[int]]) -> None:
        """Take finished deliveries out of their routes' in-flight sets."""
        pipe = self.client.pipeline(transaction=False)
        for route, ids in done.items():
            if ids:
                pipe.zrem(f"{self.prefix}f:{route}", *ids)
        pipe.execute()

    def relearn(self, processing: dict[int, list[int]]) -> bool:
        """After a flush (no ``epoch`` key; one caller wins it): the processing rows are in
        flight again. The pending ones are not put back to wait: the sweeper offers them
        again (the module docstring says why). False when another caller re-learnt."""
        if not self.client.set(self.prefix + "epoch", "1", nx=True):
            return False
        now = self.now_ms()
        pipe = self.client.pipeline(transaction=False)
        for route, ids in processing.items():
            pipe.zadd(f"{self.prefix}f:{route}", {str(i): now for i in ids}, nx=True)
            pipe.sadd(self.prefix + "routes", route)
        pipe.execute()
        return True

    def requeue(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Admitted deliveries whose publish failed: waiting again, their slots free."""
        pipe = self.client.pipeline(transaction=False)
        for route, i in pairs:
            pipe.zrem(f"{self.prefix}f:{route}", i)
            pipe.zadd(f"{self.prefix}w:{route}", {str(i): i})
            pipe.sadd(self.prefix + "waiting", route)
        pipe.execute()

    def schedule(self, delivery_id: int, delay_s: float) -> None:
        """A failed attempt's retry, due in ``delay_s`` (the dispatcher admits it then)."""
        due = self.now_ms() + max(0.0, delay_s) * 1000.0
        self.client.zadd(self.prefix + "d", {str(delivery_id): due})

    def scheduled_due(self, *, most: int = DRAIN_LIMIT) -> list[int]:
        """Scheduled retries due by Redis' clock (Postgres confirms: :func:`promote`)."""
        found: list[bytes] = self.client.zrangebyscore(  # type: ignore[assignment]
            self.prefix + "d", "-inf", self.now_ms(), 0, most
        )
        return [int(i) for i in found]

    def promote(self, due: dict[int, list[int]], gone: Sequence[int]) -> None:
        """Scheduled retries Postgres says are due: to their route's waiting set; ``gone``
        (no longer retrying: finished, swept, discarded): forgotten."""
        pipe = self.client.pipeline(transaction=True)
        for route, ids in due.items():
            pipe.zrem(self.prefix + "d", *ids)
            pipe.zadd(f"{self.prefix}w:{route}", {str(i): i for i in ids})
            pipe.sadd(self.prefix + "waiting", route)
        if gone:
            pipe.zrem(self.prefix + "d", *gone)
        pipe.execute()

    def members(self) -> list[int]:
        """Every delivery admission holds now (waiting or in flight): the sweeper leaves
        these alone (they are not lost; :func:`reconcile` frees an in-flight one whose
        message was lost, and the sweeper may then pick it)."""
        routes = self.client.sunion([self.prefix + "routes", self.prefix + "waiting"])
        pipe = self.client.pipeline(transaction=False)
        for route in routes:
            pipe.zrange(f"{self.prefix}f:{int(route)}", 0, -1)
            pipe.zrange(f"{self.prefix}w:{int(route)}", 0, -1)
        found = pipe.execute() if routes else []
        return sorted({int(m) for members in found for m in members})

    def counts(self, route_id: int) -> tuple[int, int]:
        """(in flight, waiting) of one route, as admission sees them now."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(f"{self.prefix}f:{route_id}")
        pipe.zcard(f"{self.prefix}w:{route_id}")
        in_flight, waiting = pipe.execute()
        return int(in_flight), int(waiting)


@dataclass(frozen=True)
class Drained:
    """(route, delivery id) admitted, in round-robin order; ``wake_ms``: the earliest instant
    a rate-limited route may admit again (0.0: none is waiting on its rate)."""

    admitted: list[tuple[int, int]]
    wake_ms: float


# Which in-flight members are finished: not pending, retrying or processing any more, a
# retrying one whose due time came after its admission (its attempt failed), processing with
# its lease run out (the worker died: the sweeper publishes it again), or still pending past
# the grace after its admission (its message was lost or held: the sweeper again).
_FINISHED = """
    SELECT want.id FROM unnest(%(ids)s::bigint[], %(admitted)s::double precision[])
         AS want(id, admitted_ms)
    LEFT JOIN deliveries d ON d.id = want.id
    WHERE d.id IS NULL
       OR d.status NOT IN ('pending', 'processing', 'retrying')
       OR (d.status = 'processing' AND d.lease_until <= now())
       -- retrying: admitted once due (promote_due), so a due time after the admission is a
       -- later failed attempt's (finished); one due before it waits for its claim
       OR (d.status = 'retrying'
           AND (to_timestamp(want.admitted_ms / 1000.0) < d.next_attempt_at
                OR to_timestamp(want.admitted_ms / 1000.0) < now() - %(grace)s))
       OR (d.status = 'pending'
           AND to_timestamp(want.admitted_ms / 1000.0) < now() - %(grace)s)
"""

# What is in flight after a flush: the processing rows under a live lease.
_PROCESSING = """
    SELECT route_id, array_agg(id) FROM deliveries
    WHERE status = 'processing' AND lease_until > now()
    GROUP BY route_id
"""


# Which scheduled retries Postgres says are due now (its clock), and which are no longer
# retrying at all (finished, or swept back to pending: the sweeper offered them).
_SCHEDULED = """
    SELECT want.id, d.route_id, d.status = 'retrying' AND d.next_attempt_at <= now()
    FROM unnest(%(ids)s::bigint[]) AS want(id)
    LEFT JOIN deliveries d ON d.id = want.id
    WHERE d.id IS NULL OR d.status <> 'retrying' OR d.next_attempt_at <= now()
"""


def promote_due(
    conn: psycopg.Connection[Any], admission: Admission, ids: Sequence[int] | None = None
) -> int:
    """Scheduled retries due by both clocks go to their routes' waiting sets; returns how many.
    ``ids``: those due by Redis' clock, already read (:meth:`Admission.start_round`)."""
    if ids is None:
        ids = admission.scheduled_due()
    if not ids:
        return 0
    due: dict[int, list[int]] = {}
    gone: list[int] = []
    for row in conn.execute(_SCHEDULED, {"ids": ids}).fetchall():
        if row[2]:
            due.setdefault(int(row[1]), []).append(int(row[0]))
        else:
            gone.append(int(row[0]))
    admission.promote(due, gone)
    return sum(len(v) for v in due.values())


def reconcile(conn: psycopg.Connection[Any], admission: Admission, *, grace: timedelta) -> int:
    """Free the in-flight slots of finished deliveries (Postgres decides), re-learning the
    sets first after a Redis flush. Returns how many slots it freed."""
    if not admission.client.exists(admission.prefix + "epoch"):
        rows = conn.execute(_PROCESSING).fetchall()
        admission.relearn({int(r[0]): [int(i) for i in r[1]] for r in rows})
    flights = admission.in_flight()
    ids = [i for members in flights.values() for i in members]
    if not ids:
        return 0
    admitted = [ms for members in flights.values() for ms in members.values()]
    finished = {
        int(r[0])
        for r in conn.execute(
            _FINISHED, {"ids": ids, "admitted": admitted, "grace": grace}
        ).fetchall()
    }
    if finished:
        admission.release(
            {route: [i for i in members if i in finished] for route, members in flights.items()}
        )
    return len(finished)


def offer(
    client: Any,
    connect: Callable[[], psycopg.Connection[Any]],
    dispatches: Sequence[Dispatch],
    default_budget: int,
) -> list[Dispatch]:
    """The deliveries of ``dispatches`` to publish now (the receiver's and the sweeper's
    path): one Lua call for the whole batch; the rest wait for the dispatcher. The routes'
    limits come with the receiver's deliveries (its accept read them); one statement, on the
    connection ``connect`` gives, reads those of the others (only then is it called: a
    Postgres that is down does not stop the receiver's admissions). Raises on a Redis or
    Postgres failure (the caller fails open)."""
    ids = [d.delivery_id for d in dispatches]
    routes = {
        d.delivery_id: limits_from_row(d.route, default_budget)
        for d in dispatches
        if d.route is not None
    }
    unknown = [d.delivery_id for d in dispatches if d.route is None]
    if unknown:
        routes.update(routes_of(connect(), unknown, default_budget))
    decided = Admission(client).offer(ids, routes)
    metrics.ADMISSIONS.labels("admitted").inc(len(decided.admitted) + len(decided.unknown))
    metrics.ADMISSIONS.labels("waiting").inc(len(decided.waiting))
    metrics.ADMISSIONS.labels("duplicate").inc(len(decided.duplicate))
    publish = set(decided.admitted) | set(decided.unknown)
    return [d for d in dispatches if d.delivery_id in publish]
