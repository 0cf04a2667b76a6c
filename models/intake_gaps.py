"""The I/O of intake gaps (issue 38 item 2; the logic is :mod:`core.gaps`), in plain psycopg:
the receiver's heartbeat and error counts, the read that `webhooks gaps`, the console and
`webhooks reconcile` share, and maintenance's prune.

The receiver's side costs its requests nothing but a dict increment on a 5xx answer: the
heartbeat (:class:`IntakeHeartbeat`) runs in a daemon thread of its own every
``WEBHOOKS_INTAKE_HEARTBEAT_PERIOD``, with its own short connection each time (none held), and
in the same transaction adds the errors counted since its last beat (:class:`ErrorCounts`).
While the database cannot be reached the counts stay in memory (bounded: past
:data:`MAX_KEYS` keys new ones are dropped and counted in one warning) and are added at the
first beat that works.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg

from core import gaps
from core.clock import Clock, SystemClock
from core.gaps import ALL_SOURCES, ErrorMinute, GapKind, GapReport, Segment, SourceWindow
from core.logs import get_logger
from core.providers import descriptions, reconcile_options
from core.providers import registry as providers
from core.settings import Settings

log = get_logger(__name__)

MAX_KEYS = 10_000  # (source, minute, kind) counts held while the database is away
# Rows are kept this long past the longest retry window of the sources' providers.
KEEP_MARGIN = timedelta(days=1)
DEFAULT_SINCE = timedelta(days=1)  # at least; else the longest retry window

Key = tuple[str, datetime, str]


class ErrorCounts:
    """The 5xx answers of this process not yet written, per (source, minute, kind). Added to
    on the event loop, taken by the heartbeat's thread: one lock, held for a dict update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Key, int] = {}
        self.dropped = 0

    def add(self, source: str, when: datetime, kind: GapKind) -> None:
        key = (source, when.replace(second=0, microsecond=0), kind.value)
        with self._lock:
            if key in self._counts or len(self._counts) < MAX_KEYS:
                self._counts[key] = self._counts.get(key, 0) + 1
            else:
                self.dropped += 1

    def answered(self, source: str, outcome: str, when: datetime) -> None:
        """A 503 answered with this outcome (``unavailable``: the database did not answer)."""
        kind = GapKind.DB_UNREACHABLE if outcome == "unavailable" else GapKind.ERRORS
        self.add(source, when, kind)

    def failed(self, path_id: str, when: datetime) -> None:
        """A request that raised (a bug, answered 500), under its path's source id when it has
        the form of one (else every source's)."""
        label = path_id if len(path_id) == 24 and path_id.startswith("src_") else ALL_SOURCES
        self.add(label, when, GapKind.ERRORS)

    def take(self) -> dict[Key, int]:
        with self._lock:
            taken, self._counts = self._counts, {}
            return taken

    def restore(self, taken: dict[Key, int]) -> None:
        """Give back counts a flush could not write."""
        with self._lock:
            for key, n in taken.items():
                if key in self._counts or len(self._counts) < MAX_KEYS:
                    self._counts[key] = self._counts.get(key, 0) + n
                else:
                    self.dropped += n


_EXTEND = """
UPDATE intake_heartbeats SET last_seen = now()
WHERE id = %(id)s AND last_seen >= now() - %(reach)s
RETURNING id
"""
_OPEN = """
INSERT INTO intake_heartbeats (host, pid, unreachable_since)
VALUES (%(host)s, %(pid)s, %(unreachable_since)s) RETURNING id
"""
_ADD_ERRORS = """
INSERT INTO intake_errors AS e (source, minute, kind, count)
SELECT * FROM unnest(%(sources)s::text[], %(minutes)s::timestamptz[], %(kinds)s::text[],
                     %(counts)s::int[])
ON CONFLICT (source, minute, kind) DO UPDATE SET count = e.count + EXCLUDED.count
"""


class IntakeHeartbeat:
    """This receiver process's heartbeat segments and error counts: see the module."""

    def __init__(
        self,
        settings: Settings,
        counts: ErrorCounts,
        *,
        clock: Clock | None = None,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.settings = settings
        self.counts = counts
        self.clock = clock or SystemClock()
        self.host = host or socket.gethostname()
        self.pid = os.getpid() if pid is None else pid
        self.period = settings.intake_heartbeat_period
        self.segment: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._failing_since: datetime | None = None  # this host's clock: the first failed beat
        self._dropped_told = 0

    def beat(self) -> bool:
        """Extend this process's segment (or open one) and add the errors counted; False when
        the database could not be reached (the counts are kept)."""
        taken = self.counts.take()
        timeout = max(1, round(self.settings.db_connect_timeout))
        try:
            with (
                psycopg.connect(self.settings.psycopg_dsn, connect_timeout=timeout) as conn,
                conn.transaction(),
            ):
                row = None
                if self.segment is not None:
                    reach = gaps.reach(self.period)
                    row = conn.execute(_EXTEND, {"id": self.segment, "reach": reach}).fetchone()
                if row is None:
                    opened = {
                        "host": self.host,
                        "pid": self.pid,
                        "unreachable_since": self._failing_since,
                    }
                    row = conn.execute(_OPEN, opened).fetchone()
                assert row is not None
                if taken:
                    keys = list(taken)
                    conn.execute(
                        _ADD_ERRORS,
                        {
                            "sources": [k[0] for k in keys],
                            "minutes": [k[1] for k in keys],
                            "kinds": [k[2] for k in keys],
                            "counts": [taken[k] for k in keys],
                        },
                    )
            self.segment = int(row[0])
        except psycopg.Error as exc:
            self.counts.restore(taken)
            if not self._failing:
                log.warning(
                    "intake.heartbeat_failed",
                    error_class=type(exc).__name__,
                    retry_in_s=self.period.total_seconds(),
                )
            self._failing = True
            if self._failing_since is None:
                self._failing_since = self.clock.now()
            return False
        if self._failing:
            log.info("intake.heartbeat_recorded", errors_flushed=sum(taken.values()))
        self._failing = False
        self._failing_since = None
        if self.counts.dropped > self._dropped_told:
            log.warning("intake.error_counts_dropped", dropped=self.counts.dropped)
            self._dropped_told = self.counts.dropped
        return True

    def start(self) -> None:
        """Beat from a daemon thread: at once, then every period."""
        self._thread = threading.Thread(target=self._run, name="intake-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.beat()
        while not self._stop.wait(self.period.total_seconds()):
            self.beat()

    def stop(self) -> None:
        """Stop beating, after a last beat (the segment ends where the process stopped, and
        what was counted is written); the segment is kept: it is the receiver's history."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.db_connect_timeout + 1)
        self.beat()


# ---- the read ------------------------------------------------------------------------------

_NOW = "SELECT now()"
_SEGMENTS = """
SELECT started_at, last_seen, unreachable_since FROM intake_heartbeats
WHERE last_seen >= %(from)s
UNION ALL
(SELECT started_at, last_seen, unreachable_since FROM intake_heartbeats
 WHERE last_seen < %(from)s ORDER BY last_seen DESC LIMIT 1)
"""
_ERRORS = """
SELECT source, minute, kind, count FROM intake_errors
WHERE minute > %(since)s - interval '1 minute' ORDER BY minute
"""
_SOURCES = """
SELECT public_id, name, provider, retry_window_s, reconcile_ciphertext IS NOT NULL
FROM sources WHERE active ORDER BY id
"""


def retries_by_itself(provider: str) -> bool:
    """False for a provider whose description says it never retries by itself (GitHub:
    redelivery is by hand, or by reconciliation). A plug-in: True."""
    row = descriptions.table().get(provider)
    return True if row is None else bool(row.get("retries", True))


def provider_gives_up(
    provider: str, occurred_at: datetime | None, received_at: datetime | None
) -> tuple[datetime | None, str]:
    """When ``provider`` stops retrying one event (None: it never retries by itself, or its
    window is unknown here), and that in words."""
    try:
        window, _ = providers.retry_window_of(provider)
    except ValueError:
        return None, f"unknown here ({provider} is not installed)"
    retries = retries_by_itself(provider)
    at = gaps.gives_up_at(occurred_at, received_at, window, retries)
    if at is None:
        return None, "never by itself: only a redelivery or reconciliation resends it"
    return at, f"until {at:%Y-%m-%d %H:%M:%S} UTC ({provider}'s documented window)"


def source_windows(conn: psycopg.Connection[Any]) -> list[SourceWindow]:
    out = []
    for public_id, name, provider, retry_window_s, has_key in conn.execute(_SOURCES):
        if retry_window_s is not None:
            window = timedelta(seconds=retry_window_s)
        else:
            try:
                window = providers.retry_window_of(provider)[0]
            except ValueError:  # a plug-in not installed here: nothing known of its retries
                window = timedelta()
        out.append(
            SourceWindow(
                public_id=public_id,
                name=name,
                provider=provider,
                retry_window=window,
                retries=retries_by_itself(provider) and window > timedelta(),
                reconcilable=bool(has_key) and reconcile_options.supported(provider),
            )
        )
    return out


def default_since(sources: Sequence[SourceWindow]) -> timedelta:
    """The longest retry window of the sources' providers, at least a day: every range some
    provider may still be retrying, or has just given up on."""
    return max([DEFAULT_SINCE, *(s.retry_window for s in sources)])


def read(
    conn: psycopg.Connection[Any], settings: Settings, since: timedelta | None = None
) -> GapReport:
    """The gaps of the last ``since`` (default :func:`default_since`), at the database's
    clock."""
    row = conn.execute(_NOW).fetchone()
    assert row is not None
    now: datetime = row[0]
    sources = source_windows(conn)
    start = now - (default_since(sources) if since is None else since)
    period = settings.intake_heartbeat_period
    reach = gaps.reach(period)
    segments = [
        Segment(started_at=r[0], last_seen=r[1], unreachable_since=r[2])
        for r in conn.execute(_SEGMENTS, {"from": start - reach})
    ]
    minutes = [
        ErrorMinute(source=r[0], minute=r[1], kind=GapKind(r[2]), count=r[3])
        for r in conn.execute(_ERRORS, {"since": start})
    ]
    return gaps.report(segments, minutes, sources, since=start, now=now, period=period)


# ---- maintenance -------------------------------------------------------------------------

_PRUNE_BEATS = (
    "DELETE FROM intake_heartbeats"
    " WHERE last_seen < coalesce(%(now)s::timestamptz, now()) - %(keep)s"
)
_PRUNE_ERRORS = (
    "DELETE FROM intake_errors WHERE minute < coalesce(%(now)s::timestamptz, now()) - %(keep)s"
)


def keep_for(sources: Sequence[SourceWindow]) -> timedelta:
    return default_since(sources) + KEEP_MARGIN


def prune(conn: psycopg.Connection[Any], now: datetime | None = None) -> int:
    """Delete heartbeat segments and error counts older than :func:`keep_for` (at ``now``:
    None, the database's clock); returns how many rows."""
    params = {"keep": keep_for(source_windows(conn)), "now": now}
    beats = conn.execute(_PRUNE_BEATS, params).rowcount
    errors = conn.execute(_PRUNE_ERRORS, params).rowcount
    return beats + errors
