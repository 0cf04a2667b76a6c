"""The fast claim tier in Redis: a three-state key per delivery and key generation.

    acquire  SET claim:<installation>:<delivery>:<generation> <token> NX PX processing_ttl
    confirm  SET claim:<installation>:<delivery>:<generation> <token> PX dedup_ttl (always lands)
    release  DEL claim:<installation>:<delivery>:<generation> only while it holds our token

(PX: the TTLs in milliseconds, so that fractional time budgets keep their value.) The key
generation is part of the key because an explicit re-run (generation + 1) of a succeeded
delivery must not be stopped by the previous generation's confirmed key. The installation
(:mod:`models.installation`, read once per process) is part of it because a delivery id names
a row of one database only: a database dropped and recreated starts its ids again at 1, and
two installations may share one Redis; a confirmed key lives for days.

``processing_ttl`` (4 x the hard time limit) is the crash floor: a worker killed mid-handler
runs no code, so the short expiry alone lets the next copy through. A caught failure releases
the key at once; success promotes it to the source's dedup TTL so later copies stop here
without touching Postgres.

Redis is an optimisation, never the authority: Postgres' guarded claim decides. When Redis is
unreachable, slow beyond its small socket timeout, or refusing writes (out of memory, a
read-only replica after a failover), the claim fails open: it reports
``degraded=True``, is counted and logged, and the durable tier alone decides. A flushed Redis
behaves like a first delivery and Postgres refuses the second effect. A key held for a row
Postgres shows overdue, or pending after two of the sweeper's re-publishes (a success whose
commit was lost to a restore or failover), is stale: the worker asks Postgres anyway
(:meth:`ClaimStore.note_stale`).
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from core.logs import get_logger
from core.metrics import CLAIMS, DEGRADED

log = get_logger(__name__)


class ClaimResult(enum.StrEnum):
    """A fast claim's result: the ``result`` label of ``webhooks_claims_total``."""

    FIRST = "first"  # won: no copy holds the key
    DUPLICATE = "duplicate"  # another copy holds or completed it
    DEGRADED = "degraded"  # Redis unreachable: the durable claim alone decides
    STALE_KEY = "stale_key"  # held, yet Postgres shows the row overdue


# KEYS[1] = claim key, ARGV[1] = our token. Compare-and-delete in one step, so a key that has
# expired and been re-acquired by another worker is never deleted by us.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

# ConnectionError and TimeoutError, and also the errors of a Redis that answers but refuses.
_REDIS_DOWN = (redis.RedisError,)


def claim_key(installation: str, delivery_id: int, generation: int) -> str:
    return f"claim:{installation}:{delivery_id}:{generation}"


@dataclass(frozen=True)
class FastClaim:
    key: str
    token: str
    # True: go on to the durable claim (we hold the key, or Redis is down); False: duplicate.
    first: bool
    degraded: bool


def make_client(url: str, socket_timeout: float) -> redis.Redis:
    """A client that fails within ``socket_timeout`` instead of retrying (fail open fast)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),
    )


class ClaimStore:
    """The claim keys of one installation (this database), through one Redis client."""

    def __init__(self, client: redis.Redis, *, installation: str, processing_ttl: float) -> None:
        self._client = client
        self.installation = installation
        self._ttl_ms = int(processing_ttl * 1000)
        self._release: Any = client.register_script(_RELEASE)

    def key(self, delivery_id: int, generation: int) -> str:
        return claim_key(self.installation, delivery_id, generation)

    def acquire(self, delivery_id: int, generation: int) -> FastClaim:
        key = self.key(delivery_id, generation)
        token = secrets.token_hex(8)
        try:
            won = self._client.set(key, token, nx=True, px=self._ttl_ms)
        except _REDIS_DOWN as exc:
            CLAIMS.labels(result=ClaimResult.DEGRADED).inc()
            DEGRADED.inc()
            log.warning(
                "claim.degraded",
                delivery_id=delivery_id,
                error_class=type(exc).__name__,
                tier="durable_only",
            )
            return FastClaim(key, token, first=True, degraded=True)
        CLAIMS.labels(result=ClaimResult.FIRST if won else ClaimResult.DUPLICATE).inc()
        return FastClaim(key, token, first=bool(won), degraded=False)

    def acquire_many(self, wanted: list[tuple[int, int]]) -> list[FastClaim]:
        """:meth:`acquire` for several (delivery id, generation) pairs in one round trip (a
        pipeline, not a transaction: each SET NX wins or loses on its own); one pair is a
        plain :meth:`acquire` (no pipeline to build for one command)."""
        if len(wanted) == 1:
            return [self.acquire(*wanted[0])]
        keys = [self.key(delivery_id, generation) for delivery_id, generation in wanted]
        tokens = [secrets.token_hex(8) for _ in keys]
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, token in zip(keys, tokens, strict=True):
                pipe.set(key, token, nx=True, px=self._ttl_ms)
            won = pipe.execute()
        except _REDIS_DOWN as exc:
            CLAIMS.labels(result=ClaimResult.DEGRADED).inc(len(keys))
            DEGRADED.inc(len(keys))
            log.warning(
                "claim.degraded",
                delivery_ids=[delivery_id for delivery_id, _ in wanted],
                error_class=type(exc).__name__,
                tier="durable_only",
            )
            return [
                FastClaim(k, t, first=True, degraded=True)
                for k, t in zip(keys, tokens, strict=True)
            ]
        claims = [
            FastClaim(key, token, first=bool(w), degraded=False)
            for key, token, w in zip(keys, tokens, won, strict=True)
        ]
        first = sum(c.first for c in claims)
        if first:
            CLAIMS.labels(result=ClaimResult.FIRST).inc(first)
        if len(claims) - first:
            CLAIMS.labels(result=ClaimResult.DUPLICATE).inc(len(claims) - first)
        return claims

    def confirm_many(self, confirmed: list[tuple[FastClaim, timedelta]]) -> None:
        """:meth:`confirm` for several keys in one round trip; one key is a plain
        :meth:`confirm`."""
        if len(confirmed) == 1:
            self.confirm(*confirmed[0])
            return
        confirmed = [(claim, ttl) for claim, ttl in confirmed if not claim.degraded]
        if not confirmed:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for claim, ttl in confirmed:
                pipe.set(claim.key, claim.token, px=max(1, int(ttl.total_seconds() * 1000)))
            pipe.execute()
        except _REDIS_DOWN as exc:
            log.warning(
                "claim.confirm_failed",
                keys=[claim.key for claim, _ in confirmed],
                error_class=type(exc).__name__,
            )

    def note_stale(self, claim: FastClaim, delivery_id: int) -> None:
        """The key is held but Postgres shows its row overdue, or pending after two of the
        sweeper's re-publishes: count it; the durable claim decides, and on success
        :meth:`confirm` overwrites the key with ours."""
        CLAIMS.labels(result=ClaimResult.STALE_KEY).inc()
        log.warning("claim.stale_key", delivery_id=delivery_id, key=claim.key)

    def confirm(self, claim: FastClaim, dedup_ttl: timedelta) -> bool:
        """Promote the key to the dedup TTL. No NX: it must land even though the key exists."""
        if claim.degraded:
            return False
        try:
            self._client.set(
                claim.key, claim.token, px=max(1, int(dedup_ttl.total_seconds() * 1000))
            )
        except _REDIS_DOWN as exc:
            # The processing TTL expires on its own; Postgres still blocks a second effect.
            log.warning("claim.confirm_failed", key=claim.key, error_class=type(exc).__name__)
            return False
        return True

    def release(self, claim: FastClaim) -> bool:
        """Delete the key if it still holds our token, so the next copy is a first delivery."""
        if claim.degraded:
            return False
        try:
            return bool(self._release(keys=[claim.key], args=[claim.token]))
        except _REDIS_DOWN as exc:
            log.warning("claim.release_failed", key=claim.key, error_class=type(exc).__name__)
            return False
