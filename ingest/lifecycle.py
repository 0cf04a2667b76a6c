"""What the receiver starts beside serving (moved out of :mod:`ingest.app`): the raised-TTL
report, its TTL fingerprint's heartbeat (issue 35) and its intake heartbeat (issue 38 item
2, :mod:`models.intake_gaps`), each run off the event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.clock import Clock
from core.settings import Settings
from models.intake_gaps import ErrorCounts, IntakeHeartbeat

if TYPE_CHECKING:
    from models.ttl_fingerprints import Heartbeat


def report_raised_ttls(settings: Settings) -> None:
    # Lazy: SQLAlchemy loads only for this start-up report; the receiver's path is psycopg.
    from models.catalog import report_raised_ttls  # noqa: PLC0415 (SQLAlchemy, see above)
    from models.db import make_engine  # noqa: PLC0415 (SQLAlchemy, see above)

    engine = make_engine(settings, pool_size=1)
    try:
        report_raised_ttls(engine, settings, process="receiver")
    finally:
        engine.dispose()


def record_fingerprint(settings: Settings) -> Heartbeat:
    # Lazy, as above: SQLAlchemy's text() types come with the module; the heartbeat is psycopg.
    from models.ttl_fingerprints import Heartbeat  # noqa: PLC0415 (SQLAlchemy, see above)

    heartbeat = Heartbeat(settings, "receiver")
    heartbeat.start()
    return heartbeat


def intake_heartbeat(settings: Settings, errors: ErrorCounts, clock: Clock) -> IntakeHeartbeat:
    """This receiver's intake heartbeat, beating from its own thread."""
    heartbeat = IntakeHeartbeat(settings, errors, clock=clock)
    heartbeat.start()
    return heartbeat
