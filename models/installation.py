"""The database's identity: the random id migration 0010 stores in ``installation``.

Fast-claim keys in Redis carry it (:mod:`tasks.claims`). Delivery ids alone do not name a
delivery across databases: a database dropped and recreated starts its ids again at 1, and
two installations may share one Redis. Read once per worker process, at start.
"""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.exc import ProgrammingError

from core.errors import WebhooksError


class InstallationUnknown(WebhooksError):
    """The database has no installation id: it is not migrated to revision 0010."""

    reason = "not_migrated"


def installation_id(engine: Engine) -> str:
    """This database's installation id; :class:`InstallationUnknown` when it has none."""
    try:
        with engine.connect() as conn:
            found = conn.execute(text("SELECT id FROM installation")).scalar_one_or_none()
    except ProgrammingError:  # the table does not exist
        found = None
    if found is None:
        raise InstallationUnknown(
            "the database has no installation id: migrate it first (`webhooks db upgrade`)"
        )
    return str(found)
