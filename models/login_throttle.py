"""Failed admin logins, limited per client address and in all (issue 34 item 7): the console's
login form, the admin API's bearer token and the docs' Basic password guess the same tokens,
so they share these budgets.

Two token buckets (GCRA), both counting failures only:

- **per client address** (``WEBHOOKS_CONSOLE_LOGIN_FAILURES``, 5): that many failures at once,
  then one more every minute / 5 (12 s); an IPv6 address counts as its /64, which one host
  usually holds whole;
- **global** (``WEBHOOKS_CONSOLE_LOGIN_GLOBAL_FAILURES``, 60): failures from every address
  together, that many at once, then one a second. Only attempts the client's own bucket let
  through reach it, so one address alone cannot use it up, and once an attack from many
  addresses stops a slot is free again within one interval (1 s): the operator gets in at
  once.

An attempt **reserves** a failure in both buckets before its token is compared (one atomic
step), and a success gives it back (:meth:`LoginThrottle.refund`): concurrent attempts cannot
slip past a bucket between a check and a charge, and a successful login costs nothing. An
attempt either bucket refuses is answered 429 with the seconds until a slot is free, and its
token is never compared (so guessing and timing gain nothing from it).

Where the state lives: Redis (``WEBHOOKS_REDIS_URL``, which the admin plane reaches already),
``login:c:<address>`` and ``login:g``, each bucket's theoretical arrival time in ms on
**Redis' clock** (the scripts read ``TIME`` themselves): every admin process and host shares
the budgets and one clock decides. A test pins time with a :class:`~core.clock.FrozenClock`
(:func:`core.clock.pinned`), which then stands for Redis' clock. Redis unreachable: the same
buckets in this process's memory on the plane's clock, so the login stays limited (one budget
per admin process: ``webhooks serve`` runs one admin plane, in a thread of its supervisor)
and stays usable, when operators may need the console most.
"""

from __future__ import annotations

import ipaddress
import math
import threading
from dataclasses import dataclass
from typing import Literal

import redis

from core.clock import Clock, pinned

PREFIX = "login:"
PERIOD_MS = 60_000.0  # the budgets are per minute
# The most client buckets kept in memory while Redis is away (the emptiest are dropped).
MAX_LOCAL_CLIENTS = 10_000

Scope = Literal["client", "global"]
Store = Literal["redis", "process"]

# KEYS: the buckets (client, global); ARGV 1: now in ms, or -1 for Redis' TIME; then per key
# its interval (ms) and size. Answers {0, 0} (reserved in every bucket) or {i, wait ms} for
# the first bucket that is full (nothing reserved anywhere).
_TAKE = """
local now = tonumber(ARGV[1])
if now < 0 then
    local clock = redis.call('TIME')
    now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
end
local tats = {}
for i = 1, #KEYS do
    local interval = tonumber(ARGV[2 * i])
    local size = tonumber(ARGV[2 * i + 1])
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
    if tat < now then tat = now end
    local wait = tat - now - (size - 1) * interval
    if wait > 0 then return {i, tostring(wait)} end
    tats[i] = tat + interval
end
for i = 1, #KEYS do
    redis.call('SET', KEYS[i], tostring(tats[i]), 'PX', math.ceil(tats[i] - now) + 1000)
end
return {0, '0'}
"""

# A success gives its reservation back: KEYS as above, ARGV 1 now (or -1), then each
# bucket's interval (ms).
_REFUND = """
local now = tonumber(ARGV[1])
if now < 0 then
    local clock = redis.call('TIME')
    now = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000
end
for i = 1, #KEYS do
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0') - tonumber(ARGV[i + 1])
    if tat <= now then
        redis.call('DEL', KEYS[i])
    else
        redis.call('SET', KEYS[i], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
    end
end
return 0
"""


@dataclass(frozen=True)
class Bucket:
    """``size`` failures at once, refilled at ``size`` a minute."""

    size: int

    @property
    def interval_ms(self) -> float:
        return PERIOD_MS / self.size


@dataclass(frozen=True)
class Decision:
    """What the throttle said about one attempt. Refused: ``scope`` names the full bucket and
    ``retry_after`` the whole seconds until it has room."""

    allowed: bool
    store: Store
    scope: Scope | None = None
    retry_after: int = 0


def client_key(host: str | None) -> str:
    """The bucket of a client address: an IPv4 address as is (also inside IPv6), an IPv6
    address as its /64; anything else (no address, a Unix socket) shares ``unknown``."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return "unknown"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _retry_after(wait_ms: float) -> int:
    return max(1, math.ceil(wait_ms / 1000.0))


class LoginThrottle:
    """The buckets of one admin plane (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis | None,
        clock: Clock,
        *,
        per_client: int,
        overall: int,
        prefix: str = PREFIX,
    ) -> None:
        self.redis = client
        self.clock = clock
        self.buckets = (Bucket(per_client), Bucket(overall))
        self.prefix = prefix
        self._take = client.register_script(_TAKE) if client is not None else None
        self._refund = client.register_script(_REFUND) if client is not None else None
        self._lock = threading.Lock()
        self._local: dict[str, float] = {}  # bucket key -> its theoretical arrival time (ms)

    def _keys(self, address: str) -> list[str]:
        return [f"{self.prefix}c:{address}", f"{self.prefix}g"]

    def _now_arg(self) -> float:
        at = pinned(self.clock)
        return -1.0 if at is None else at.timestamp() * 1000.0

    def take(self, address: str) -> Decision:
        """Reserve one failure for an attempt from ``address`` (a :func:`client_key`), or
        refuse it. Raises nothing: Redis unreachable, this process's buckets decide."""
        if self._take is not None:
            args: list[float] = [self._now_arg()]
            for bucket in self.buckets:
                args += [bucket.interval_ms, bucket.size]
            try:
                which, wait = self._take(keys=self._keys(address), args=args)
            except redis.RedisError:
                pass
            else:
                return self._decision("redis", int(which), float(wait))
        which, wait = self._take_local(address)
        return self._decision("process", which, wait)

    def refund(self, address: str, decision: Decision) -> None:
        """Give back an allowed attempt's reservation: it was no failure."""
        if not decision.allowed:
            return
        if decision.store == "redis" and self._refund is not None:
            args = [self._now_arg(), *(b.interval_ms for b in self.buckets)]
            try:
                self._refund(keys=self._keys(address), args=args)
            except redis.RedisError:
                pass  # the reservation stays: one failure counted too many, until it drains
            return
        now = self.clock.now().timestamp() * 1000.0
        with self._lock:
            for key, bucket in zip(self._keys(address), self.buckets, strict=True):
                tat = self._local.get(key, 0.0) - bucket.interval_ms
                if tat <= now:
                    self._local.pop(key, None)
                else:
                    self._local[key] = tat

    def _decision(self, store: Store, which: int, wait_ms: float) -> Decision:
        if which == 0:
            return Decision(True, store)
        scope: Scope = "client" if which == 1 else "global"
        return Decision(False, store, scope, _retry_after(wait_ms))

    def _take_local(self, address: str) -> tuple[int, float]:
        """:data:`_TAKE` in this process's memory, on the plane's clock."""
        now = self.clock.now().timestamp() * 1000.0
        keys = self._keys(address)
        with self._lock:
            tats = []
            for i, (key, bucket) in enumerate(zip(keys, self.buckets, strict=True), start=1):
                tat = max(self._local.get(key, 0.0), now)
                wait = tat - now - (bucket.size - 1) * bucket.interval_ms
                if wait > 0:
                    return i, wait
                tats.append(tat + bucket.interval_ms)
            if len(self._local) >= MAX_LOCAL_CLIENTS:
                self._prune(now)
            self._local.update(zip(keys, tats, strict=True))
        return 0, 0.0

    def _prune(self, now: float) -> None:
        """Drop the buckets that are empty again, then (still too many) the emptiest half
        of the clients' (the global one stays)."""
        for key in [k for k, tat in self._local.items() if tat <= now]:
            del self._local[key]
        if len(self._local) >= MAX_LOCAL_CLIENTS:
            clients = sorted((tat, k) for k, tat in self._local.items() if k != self._keys("")[1])
            for _, key in clients[: len(clients) // 2]:
                del self._local[key]
