"""Console sessions: server-side, in the admin plane's process (pure core, injected clock).

The cookie holds a random session id only; the store keeps its SHA-256 digest, the name of
the admin token that logged in, a digest of that token (a session ends when its token is
removed or changed), the CSRF token of the session and when it was last used. A session
unused for ``idle`` is gone; logout removes it at once. A restart of the process ends every
session (operators log in again).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from core.clock import Clock

MAX_SESSIONS = 1000  # the oldest are dropped beyond this


def digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


@dataclass
class ConsoleSession:
    operator: str  # the admin token's name: what every audit row records
    token_digest: bytes
    csrf: str
    last_seen: datetime


class SessionStore:
    def __init__(self, clock: Clock, idle: timedelta) -> None:
        self.clock = clock
        self.idle = idle
        self._lock = threading.Lock()
        self._sessions: dict[bytes, ConsoleSession] = {}

    def create(self, operator: str, token_digest: bytes) -> tuple[str, ConsoleSession]:
        """A new session; returns (the cookie's value, the session)."""
        sid = secrets.token_urlsafe(32)
        session = ConsoleSession(
            operator, token_digest, secrets.token_urlsafe(32), self.clock.now()
        )
        with self._lock:
            self._expire()
            if len(self._sessions) >= MAX_SESSIONS:
                oldest = min(self._sessions, key=lambda k: self._sessions[k].last_seen)
                del self._sessions[oldest]
            self._sessions[digest(sid)] = session
        return sid, session

    def get(self, sid: str | None, valid_tokens: set[bytes]) -> ConsoleSession | None:
        """The live session of this cookie, touched (its idle time starts again); None when
        unknown, idle too long, or its token is no longer configured."""
        if not sid:
            return None
        key = digest(sid)
        now = self.clock.now()
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if now - session.last_seen >= self.idle or session.token_digest not in valid_tokens:
                del self._sessions[key]
                return None
            session.last_seen = now
            return session

    def end(self, sid: str | None) -> None:
        if sid:
            with self._lock:
                self._sessions.pop(digest(sid), None)

    def _expire(self) -> None:
        now = self.clock.now()
        for key in [k for k, s in self._sessions.items() if now - s.last_seen >= self.idle]:
            del self._sessions[key]


def same(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a submitted token with the expected one."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
