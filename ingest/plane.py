"""What the admin API (:mod:`ingest.admin`) and the console (:mod:`ingest.console`) of one
admin plane share: the named admin tokens, the database and broker they reach, and the
replays this process runs (so both count the same running replays, and the console can
cancel one the API started).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import SecretStr
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core import metrics
from core.clock import Clock
from core.logs import get_logger
from core.settings import Settings
from ingest.console.sessions import SessionStore
from models import replays
from models.db import make_engine, make_sessionmaker
from models.login_throttle import Decision, LoginThrottle
from tasks.claims import make_client
from tasks.publisher import CeleryPublisher

log = get_logger("admin")

MAX_RUNNING_REPLAYS = 2  # per process; more are refused (429)


def digest(token: bytes) -> bytes:
    """A token's SHA-256: what is kept and compared, 32 bytes whatever the token's length."""
    return hashlib.sha256(token).digest()


def secure_cookie(settings: Settings, scheme: str) -> bool:
    """Whether a cookie of the admin plane (the console's session and login cookies, the API
    docs' session) is ``Secure``: when the request came over https, or always with
    ``WEBHOOKS_CONSOLE_SECURE_COOKIES`` (behind a TLS-terminating proxy). ``scheme`` is the
    ASGI scope's: ``webhooks serve`` never rewrites it from ``X-Forwarded-Proto``
    (``proxy_headers=False``), and uvicorn run with ``--proxy-headers`` does only for the
    proxies ``--forwarded-allow-ips`` trusts, so a client cannot claim https itself."""
    return settings.console_secure_cookies or scheme == "https"


class OperatorTokens:
    """The named admin tokens (``WEBHOOKS_ADMIN_TOKENS``; ``WEBHOOKS_ADMIN_TOKEN`` is named
    ``admin``), kept as digests. Empty: the admin plane is off."""

    def __init__(self, tokens: Mapping[str, SecretStr]) -> None:
        self.named = [(name, digest(t.get_secret_value().encode())) for name, t in tokens.items()]
        self.digests = {d for _, d in self.named}

    def __bool__(self) -> bool:
        return bool(self.named)

    def match(self, given: bytes | None) -> tuple[str, bytes] | None:
        """The (name, digest) of the token ``given`` is, else None. Every token is compared,
        a match or not, so timing tells nothing of which or how many."""
        given_digest = digest(given or b"")
        found = None
        for name, expected in self.named:
            if hmac.compare_digest(given_digest, expected) and given:
                found = (name, expected)
        return found


def login_throttle(settings: Settings, clock: Clock) -> LoginThrottle:
    """The plane's login throttle (:mod:`models.login_throttle`), its budgets in Redis."""
    return LoginThrottle(
        make_client(settings.redis_url, settings.redis_socket_timeout),
        clock,
        per_client=settings.console_login_failures,
        overall=settings.console_login_global_failures,
    )


def throttled(decision: Decision, client: str, via: str) -> str:
    """Count and log (one line) an attempt the throttle refused; the operator's message."""
    metrics.LOGINS_THROTTLED.labels(scope=decision.scope, via=via).inc()
    log.warning(
        "login.throttled",
        client=client,
        scope=decision.scope,
        retry_after=decision.retry_after,
        store=decision.store,
        via=via,
    )
    seconds = "1 second" if decision.retry_after == 1 else f"{decision.retry_after} seconds"
    where = "from this address" if decision.scope == "client" else "from all addresses"
    return f"too many failed logins {where}: wait {seconds} before trying again"


class PlaneState:
    """Lazily built per-process resources (the mounted apps have no lifespan of their own)."""

    def __init__(self, settings: Settings, clock: Clock, tokens: OperatorTokens) -> None:
        self.settings = settings
        self.clock = clock
        self.tokens = tokens
        self.throttle = login_throttle(settings, clock)
        # The console's sessions: AdminGuard checks the cookie against them before it reads a
        # console request's body, the console to know its operator.
        self.console_sessions = SessionStore(clock, settings.console_idle_timeout)
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._publisher: CeleryPublisher | None = None
        self.running = threading.BoundedSemaphore(MAX_RUNNING_REPLAYS)
        # The replays this process runs, by id: set to cancel one (the console's Cancel).
        self.cancels: dict[int, threading.Event] = {}
        # What /metrics reads, read afresh (the admin server sets it): the console's degraded
        # card reads this process's fail-open counts from it.
        self.read_metrics: Callable[[], Any] | None = None

    @property
    def sessions(self) -> sessionmaker[Session]:
        with self._lock:
            if self._sessions is None:
                self._engine = make_engine(self.settings, pool_size=2)
                self._sessions = make_sessionmaker(self._engine)
            return self._sessions

    @property
    def publisher(self) -> CeleryPublisher:
        with self._lock:
            if self._publisher is None:
                self._publisher = CeleryPublisher(self.settings)
            return self._publisher

    def start_replay(self, plan: replays.Plan) -> int | None:
        """Write the planned replay's audit row and run it in a background thread at its
        rate; its id, or None when :data:`MAX_RUNNING_REPLAYS` already run here."""
        if not self.running.acquire(blocking=False):
            return None
        try:
            replay_id = replays.start_replay(self.sessions, plan, now=self.clock.now())
        except BaseException:
            self.running.release()
            raise
        self._run_in_background(plan, replay_id)
        return replay_id

    def _run_in_background(self, plan: replays.Plan, replay_id: int) -> None:
        cancel = self.cancels.setdefault(replay_id, threading.Event())

        def work() -> None:
            try:
                replays.execute(
                    self.sessions,
                    plan,
                    replay_id,
                    settings=self.settings,
                    clock=self.clock,
                    sleep=lambda seconds: _wait(cancel, seconds),
                    publish=self.publisher,
                    cancelled=cancel.is_set,
                )
            except Exception as exc:  # noqa: BLE001  (the audit row says failed; log the class)
                log.error("replay.failed", replay_id=replay_id, error=exc.__class__.__name__)
            finally:
                self.cancels.pop(replay_id, None)
                self.running.release()

        threading.Thread(target=work, name=f"replay-{replay_id}", daemon=True).start()


def _wait(event: threading.Event, seconds: float) -> None:
    """A replay's pacing sleep, cut short by a cancel."""
    event.wait(seconds)
