"""Each receiver's and worker's dedup TTL inputs in Postgres (``ttl_fingerprints``, migration
0024), and the check that compares them (:mod:`core.ttl_fingerprint`).

A process records its row when it starts (:meth:`Heartbeat.start`: one upsert keyed by
(host, pid, role), ``started_at`` and ``last_seen`` the database's ``now()``), refreshes
``last_seen`` every fifth of ``WEBHOOKS_TTL_FINGERPRINT_STALE_AFTER`` from a daemon thread
(its own short connection each time: no connection held, nothing on the receiver's request
path), and deletes it when it stops cleanly. A process killed outright leaves its row, which
stops counting once not seen for the stale period (the database's clock, so no host's clock
decides) and is removed by the next maintenance run (:func:`check` with ``prune``). A pid
reused on a host starts the row again: the key names a process, not a program.

Recording never stops a process: a database that cannot be reached (or a schema a migration
behind) is one warning, and the heartbeat records the row once it can.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import Connection, text

from core.logs import get_logger
from core.providers import registry
from core.settings import Settings
from core.ttl import TtlOverrides
from core.ttl_fingerprint import (
    Disagreement,
    FingerprintError,
    ProcessTerms,
    Role,
    SourceTerms,
    TtlInputs,
    compare,
)

log = get_logger(__name__)

# The heartbeat's period is this fraction of the stale period: four beats may fail (a
# Postgres restart, a long pause) before the row stops counting.
BEATS_PER_STALE_PERIOD = 5

# ``started_at`` moves only at a start: a heartbeat that finds its row gone (pruned while
# the process was cut off) records it again from the beat on.
_RECORD = """
INSERT INTO ttl_fingerprints AS f (host, pid, role, environment, digest, terms)
VALUES (%(host)s, %(pid)s, %(role)s, %(environment)s, %(digest)s, %(terms)s)
ON CONFLICT (host, pid, role) DO UPDATE
SET environment = EXCLUDED.environment, digest = EXCLUDED.digest, terms = EXCLUDED.terms,
    started_at = CASE WHEN %(start)s THEN now() ELSE f.started_at END,
    last_seen = now()
"""
_FORGET = "DELETE FROM ttl_fingerprints WHERE host = %(host)s AND pid = %(pid)s AND role = %(role)s"

_LIVE = """
SELECT host, pid, role, environment, started_at, last_seen, terms
FROM ttl_fingerprints
WHERE last_seen > coalesce(CAST(:now AS timestamptz), now()) - CAST(:stale AS interval)
ORDER BY host, pid, role
"""
_PRUNE = """
DELETE FROM ttl_fingerprints
WHERE last_seen <= coalesce(CAST(:now AS timestamptz), now()) - CAST(:stale AS interval)
"""
_SOURCES = """
SELECT public_id, name, provider, retry_window_s, queue_lag_s, clock_skew_s, replay_grace_s
FROM sources ORDER BY id
"""


def this_process_inputs(settings: Settings) -> TtlInputs:
    """This process's inputs: its registry's windows (plug-ins included) and its settings."""
    windows = {name: p.retry_window for name, p in registry.providers().items()}
    return TtlInputs.of(settings, windows)


class Heartbeat:
    """This process's row: recorded at :meth:`start`, refreshed by a daemon thread, deleted at
    :meth:`stop`."""

    def __init__(
        self,
        settings: Settings,
        role: Role,
        *,
        inputs: TtlInputs | None = None,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.settings = settings
        self._inputs = inputs
        self.key = {
            "host": host or socket.gethostname(),
            "pid": os.getpid() if pid is None else pid,
            "role": role,
        }
        self.interval = settings.ttl_fingerprint_stale_after / BEATS_PER_STALE_PERIOD
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def inputs(self) -> TtlInputs:
        """Given, or this process's, read at the first beat (its registry loaded by then)."""
        if self._inputs is None:
            self._inputs = this_process_inputs(self.settings)
        return self._inputs

    def _execute(self, sql: str, params: dict[str, Any]) -> None:
        timeout = max(1, round(self.settings.db_connect_timeout))
        with psycopg.connect(
            self.settings.psycopg_dsn, autocommit=True, connect_timeout=timeout
        ) as conn:
            conn.execute(sql, params)

    def beat(self, *, start: bool = False) -> bool:
        """Record (``start``: as a new process) or refresh the row; False when it could not
        (one warning when it starts failing, one info line when it works again)."""
        params = {
            **self.key,
            "environment": self.settings.environment,
            "digest": self.inputs.digest(),
            "terms": Jsonb(self.inputs.as_json()),
            "start": start,
        }
        try:
            self._execute(_RECORD, params)
        except psycopg.Error as exc:
            if not self._failing:
                log.warning(
                    "ttl_fingerprint.unrecorded",
                    role=self.key["role"],
                    error_class=type(exc).__name__,
                    retry_in_s=self.interval.total_seconds(),
                )
            self._failing = True
            return False
        if start or self._failing:
            log.info(
                "ttl_fingerprint.recorded",
                role=self.key["role"],
                host=self.key["host"],
                pid=self.key["pid"],
                digest=params["digest"],
            )
        self._failing = False
        return True

    def start(self, *, wait: bool = True) -> None:
        """Record the row, then refresh it from a daemon thread. ``wait``: record it before
        returning (one round trip; up to the connect timeout when Postgres is away), else
        from the thread (a worker's main thread runs its consumer and must not block)."""
        if wait:
            self.beat(start=True)
        self._thread = threading.Thread(
            target=self._run, args=(not wait,), name="ttl-fingerprint", daemon=True
        )
        self._thread.start()

    def _run(self, first: bool) -> None:
        if first:
            self.beat(start=True)
        while not self._stop.wait(self.interval.total_seconds()):
            self.beat()

    def stop(self) -> None:
        """Stop refreshing and delete the row (a failure leaves it to age out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.settings.db_connect_timeout + 1)
        try:
            self._execute(_FORGET, self.key)
        except psycopg.Error as exc:
            log.info("ttl_fingerprint.left_to_age_out", error_class=type(exc).__name__)


@dataclass(frozen=True)
class FingerprintCheck:
    """The live processes, those of their rows that could not be read, what they disagree
    on, and how many dead processes' rows were removed."""

    at: datetime  # the instant compared at (the database's clock, or the pinned one)
    processes: tuple[ProcessTerms, ...]
    unreadable: tuple[tuple[str, int, str], ...]
    disagreements: tuple[Disagreement, ...]
    pruned: int


def _sources(conn: Connection) -> list[SourceTerms]:
    return [
        SourceTerms(
            public_id=r.public_id,
            name=r.name,
            provider=r.provider,
            overrides=TtlOverrides.from_seconds(
                r.retry_window_s, r.queue_lag_s, r.clock_skew_s, r.replay_grace_s
            ),
        )
        for r in conn.execute(text(_SOURCES))
    ]


def _live(
    conn: Connection, now: datetime | None, stale: timedelta
) -> tuple[list[ProcessTerms], list[tuple[str, int, str]]]:
    found, unreadable = [], []
    for r in conn.execute(text(_LIVE), {"now": now, "stale": stale}):
        try:
            inputs = TtlInputs.from_json(r.terms)
        except FingerprintError:
            unreadable.append((r.host, r.pid, r.role))
            continue
        found.append(
            ProcessTerms(r.host, r.pid, r.role, r.environment, r.started_at, r.last_seen, inputs)
        )
    return found, unreadable


def check(
    conn: Connection, settings: Settings, now: datetime | None, *, prune: bool = False
) -> FingerprintCheck:
    """Compare the live processes' inputs over every source (``now``: None, the database's
    clock; a pinned instant in tests). ``prune`` (maintenance): first delete the rows of the
    processes not seen for the stale period. The caller commits."""
    stale = settings.ttl_fingerprint_stale_after
    at: datetime = conn.execute(
        text("SELECT coalesce(CAST(:now AS timestamptz), now())"), {"now": now}
    ).scalar_one()
    pruned = conn.execute(text(_PRUNE), {"now": at, "stale": stale}).rowcount if prune else 0
    processes, unreadable = _live(conn, at, stale)
    disagreements = compare(processes, _sources(conn))
    return FingerprintCheck(at, tuple(processes), tuple(unreadable), disagreements, pruned)


def describe(d: Disagreement) -> dict[str, Any]:
    """One disagreement for a log line or ``--json``: the source, each process's TTL (seconds;
    None: provider not installed there) and the values of the terms that differ."""
    return {
        "source": d.source.public_id,
        "name": d.source.name,
        "provider": d.source.provider,
        "differing": list(d.differing),
        "processes": [
            {
                "host": x.process.host,
                "pid": x.process.pid,
                "role": x.process.role,
                "environment": x.process.environment,
                "dedup_ttl_s": None if x.ttl is None else x.ttl.total_seconds(),
                "terms": {name: _seconds(x.values[name]) for name in d.differing},
            }
            for x in d.derived
        ],
    }


def _seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def keys(processes: Sequence[ProcessTerms]) -> list[str]:
    return [f"{p.host}:{p.pid}:{p.role}" for p in processes]
