"""Naming what a worker dies for: the crash marks its watchdog writes just before the kill.

A worker killed by its own watchdog (:mod:`tasks.pools`: a thread stuck in a C call past
1.5 x the hard limit, or a gevent loop blocked for the hard limit) takes every delivery it
had in flight with it: up to every slot's message. Each of them is claimed again once its
lease runs out, and that claim used to count a crash for each (``max_redeliveries``), so a
stuck handler spent its innocent neighbours' crash budgets, and sent them to the dead
letters as ``crashed`` after a few such kills.

Before the kill, :func:`report` marks in Postgres the stuck deliveries ``suspect`` and the
others whose handlers this process runs ``bystander`` (:func:`models.crash_marks.mark_crash`,
each guarded by its attempt). The claim counts a crash only against an unmarked or suspect
row, so a bystander loses nothing but its lease time. Then the sweeper republishes each
lease-expired row alone (one id per message), and a requeued copy of a batch message hands
its lease-expired rows on one per message too (:func:`tasks.steps.claim.isolate`): the
suspect runs alone and, if it is stuck again, dies alone, until its own
``max_redeliveries`` makes it dead.

Best effort, bounded: a fresh connection (the pool's may all be busy, or held by the stuck
thread), a short connect timeout and statement timeout; any failure is logged and the kill
goes on. A mark that did not land leaves the old rule (every redelivery counts), as does a
kill -9 from outside, which gives no chance to name anyone.
"""

from __future__ import annotations

import psycopg

from core.logs import get_logger
from core.settings import Settings
from models import crash_marks
from models.crash_marks import Held

log = get_logger(__name__)

# Seconds the connection and the statement may take: the kill waits for at most about both.
MARK_TIMEOUT = 2


def report(settings: Settings, suspects: list[Held], bystanders: list[Held]) -> int:
    """Mark the attempts of a worker about to die (see the module's docstring); returns how
    many rows were marked. Raises on a database error (the watchdog logs it and kills)."""
    with psycopg.connect(
        settings.psycopg_dsn,
        autocommit=True,
        connect_timeout=MARK_TIMEOUT,
        options=f"-c statement_timeout={MARK_TIMEOUT * 1000} -c lock_timeout={MARK_TIMEOUT * 500}",
    ) as conn:
        marked = crash_marks.mark_crash(conn, suspects, bystanders)
    log.warning(
        "worker.crash_marked",
        suspects=[h.id for h in suspects],
        bystanders=[h.id for h in bystanders],
        marked=marked,
    )
    return marked
