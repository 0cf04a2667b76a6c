"""The downstream idempotency key of one event on one route, in one key generation: what the
worker sends (:mod:`tasks.context`, which re-exports it) and what ``webhooks deliveries show``
prints, computed here with no Celery or database module imported."""

from __future__ import annotations

import hashlib

KEY_PREFIX = "whk_"


def idempotency_key(source_id: int, event_id: str, route_id: int, generation: int) -> str:
    """The downstream idempotency key of one event on one route, in one key generation.

    The source id is the dedup scope (one account's integration, stable across secret
    rotation), so the same provider event id seen by two accounts never shares a key.
    """
    material = f"{source_id}\x1f{event_id}\x1f{route_id}\x1f{generation}".encode()
    return KEY_PREFIX + hashlib.sha256(material).hexdigest()[:32]
