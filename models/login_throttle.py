"""Failed admin logins, limited per client address and in all (issue 34 item 7): the console's
login form, the admin API's bearer token and the docs' Basic password guess the same tokens,
so they share these budgets.

Two token buckets (GCRA), both counting failures only:

- **per client address** (``WEBHOOKS_CONSOLE_LOGIN_FAILURES``, 5): that many failures at once,
  then one more every minute / 5 (12 s); an IPv6 address counts as its /64, which one host
  usually holds whole;
- **global** (``WEBHOOKS_CONSOLE_LOGIN_GLOBAL_FAILURES``, 60): failures from every address
  together, that many at once, then one a second. An attempt its address's bucket refuses
  is no failure (its token is not compared), so one address alone cannot use it up; once an
  attack from many addresses stops, a slot is free again within one interval (1 s, a second
  more for each failure charged past a full bucket: see below) and the operator gets in.

Before its token is compared an attempt is **checked** against both buckets (one atomic
read); refused, it is answered 429 with the seconds until a slot is free, and its token is
never compared (so guessing and timing gain nothing from it). Only a failure is then
**charged** to both (:meth:`LoginThrottle.failed`): a success costs nothing, however many
requests a client makes at once. Attempts checked at the same moment can all pass before
their failures are charged (at most the requests in flight: the admin port takes 64
connections per process), but each failure is charged in full, so the bucket's arrival time
moves past them and the address (or everyone) waits that much longer: over any longer span
the rates hold exactly.

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
PERIOD_MS = 60_000  # the budgets are per minute
# The most client buckets kept in memory while Redis is away (the emptiest are dropped).
MAX_LOCAL_CLIENTS = 10_000

Scope = Literal["client", "global"]
Store = Literal["redis", "process"]

# Both scripts start here: ARGV 1 is now in ms, or -1 for Redis' own clock (TIME).
_NOW = """
local now = tonumber(ARGV[1])
if now < 0 then
    local clock = redis.call('TIME')
    now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
"""

# KEYS: the buckets (client, global); ARGV 1: now (see _NOW); then per key its interval (ms)
# and size. Answers {0, 0} (room in every bucket) or {i, wait ms} for the first bucket that is
# full. Writes nothing.
_CHECK = (
    _NOW
    + """
for i = 1, #KEYS do
    local interval = tonumber(ARGV[2 * i])
    local size = tonumber(ARGV[2 * i + 1])
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
    if tat < now then tat = now end
    local wait = tat - now - (size - 1) * interval
    if wait > 0 then return {i, tostring(wait)} end
end
return {0, '0'}
"""
)

# A failure, charged to every bucket: KEYS and ARGV as above.
_CHARGE = (
    _NOW
    + """
for i = 1, #KEYS do
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
    if tat < now then tat = now end
    tat = tat + tonumber(ARGV[2 * i])
    redis.call('SET', KEYS[i], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
end
return 0
"""
)


@dataclass(frozen=True)
class Bucket:
    """``size`` failures at once, refilled at ``size`` a minute. Times are whole
    milliseconds, so the arrival times Redis keeps as text are exact."""

    size: int

    @property
    def interval_ms(self) -> int:
        return math.ceil(PERIOD_MS / self.size)


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
        self._check = client.register_script(_CHECK) if client is not None else None
        self._charge = client.register_script(_CHARGE) if client is not None else None
        self._lock = threading.Lock()
        self._local: dict[str, int] = {}  # bucket key -> its theoretical arrival time (ms)

    def _keys(self, address: str) -> list[str]:
        return [f"{self.prefix}c:{address}", f"{self.prefix}g"]

    def _now_ms(self) -> int:
        return math.floor(self.clock.now().timestamp() * 1000)

    def _args(self) -> list[int]:
        args = [-1 if pinned(self.clock) is None else self._now_ms()]
        for bucket in self.buckets:
            args += [bucket.interval_ms, bucket.size]
        return args

    def check(self, address: str) -> Decision:
        """May an attempt from ``address`` (a :func:`client_key`) have its token compared?
        Raises nothing: Redis unreachable, this process's buckets decide."""
        if self._check is not None:
            try:
                which, wait = self._check(keys=self._keys(address), args=self._args())
            except redis.RedisError:
                pass
            else:
                return _decision("redis", int(which), float(wait))
        return _decision("process", *self._check_local(address))

    def failed(self, address: str, decision: Decision) -> None:
        """Charge a failed attempt to the buckets of the store that checked it."""
        if decision.store == "redis" and self._charge is not None:
            try:
                self._charge(keys=self._keys(address), args=self._args())
            except redis.RedisError:
                pass  # gone since the check: counted in this process's buckets instead
            else:
                return
        now = self._now_ms()
        with self._lock:
            if len(self._local) >= MAX_LOCAL_CLIENTS:
                self._prune(now)
            for key, bucket in zip(self._keys(address), self.buckets, strict=True):
                self._local[key] = max(self._local.get(key, 0), now) + bucket.interval_ms

    def _check_local(self, address: str) -> tuple[int, int]:
        """:data:`_CHECK` in this process's memory, on the plane's clock."""
        now = self._now_ms()
        with self._lock:
            for i, (key, bucket) in enumerate(
                zip(self._keys(address), self.buckets, strict=True), start=1
            ):
                tat = max(self._local.get(key, 0), now)
                wait = tat - now - (bucket.size - 1) * bucket.interval_ms
                if wait > 0:
                    return i, wait
        return 0, 0

    def _prune(self, now: int) -> None:
        """Drop the buckets that are empty again, then (still too many) the emptiest half
        of the clients' (the global one stays)."""
        for key in [k for k, tat in self._local.items() if tat <= now]:
            del self._local[key]
        if len(self._local) >= MAX_LOCAL_CLIENTS:
            overall = f"{self.prefix}g"
            clients = sorted((tat, k) for k, tat in self._local.items() if k != overall)
            for _, key in clients[: len(clients) // 2]:
                del self._local[key]


def _decision(store: Store, which: int, wait_ms: float) -> Decision:
    if which == 0:
        return Decision(True, store)
    scope: Scope = "client" if which == 1 else "global"
    return Decision(False, store, scope, _retry_after(wait_ms))
