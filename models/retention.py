"""Expiry maintenance: partitions ahead, drop the past; batched delete fallback; payloads."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Engine

from models import partitions
from webhooks.settings import Settings

# Longest dedup TTL any source may have, used to decide how far ahead partitions must exist.
MAX_TTL = timedelta(days=45)


def ensure_partitions(engine: Engine, settings: Settings, now: datetime) -> list[str]:
    """Create daily partitions from yesterday to now + MAX_TTL + partition_ahead_days."""
    created: list[str] = []
    first = (now - timedelta(days=1)).date()
    last = (now + MAX_TTL + timedelta(days=settings.partition_ahead_days)).date()
    with engine.begin() as conn:
        day = first
        while day <= last:
            created += partitions.create_day(conn, day)
            day += timedelta(days=1)
    return created
