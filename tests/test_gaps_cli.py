"""``webhooks gaps`` at 80 columns, and its refusal of a bad ``--since`` (issue 38 item 2's
output, issue 20's width rule): the real CLI against real Postgres, the receivers' heartbeats
and error counts written as the receivers write them, on the database's clock."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.docs import TOPICS
from core.settings import Settings
from tests.conftest import test_env
from tests.factories import make_source
from tests.leakcheck import remember
from tests.operators_support import cli

WIDTH = 80


@pytest.fixture
def gaps_alone(settings: Settings) -> Iterator[None]:
    """No heartbeat or error count of an earlier test, and the sources other tests left
    active set aside (restored after)."""
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM intake_heartbeats")
        conn.execute("DELETE FROM intake_errors")
        others = [r[0] for r in conn.execute("UPDATE sources SET active = false WHERE active"
                                             " RETURNING id")]  # fmt: skip
    try:
        yield
    finally:
        with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM intake_heartbeats")
            conn.execute("DELETE FROM intake_errors")
            conn.execute("UPDATE sources SET active = true WHERE id = ANY(%s)", (others,))


def _sql(settings: Settings, statement: str, *params: Any) -> None:
    with psycopg.connect(settings.psycopg_dsn, autocommit=True) as conn:
        conn.execute(statement, params or None)


@pytest.mark.usefixtures("gaps_alone")
def test_gaps_fits_80_columns_and_says_everything_it_said(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    """A range with no receiver, one of 503s, three providers' verdicts (one that retries,
    one that does not retry at all): every line of the output within 80 columns, the prose
    wrapped between words (nothing of it lost), the tables fitted."""
    for provider in ("stripe", "github", "shopify"):
        made = make_source(sessions, settings, provider=provider, name=f"gaps-{provider}")
        remember(made.secret)
    # One receiver up from 3 h ago to 2 h ago, another from 1 h ago until now; 41 503s
    # answered 30 minutes ago, for every source.
    _sql(
        settings,
        "INSERT INTO intake_heartbeats (host, pid, started_at, last_seen) VALUES"
        " ('gaps-a', 1, now() - interval '3 hours', now() - interval '2 hours'),"
        " ('gaps-b', 2, now() - interval '1 hour', now())",
    )
    _sql(
        settings,
        "INSERT INTO intake_errors (source, minute, kind, count) VALUES"
        " ('unknown', date_trunc('minute', now() - interval '30 minutes'),"
        " 'database_unreachable', 41)",
    )
    env = test_env(COLUMNS=str(WIDTH), LINES="50", WEBHOOKS_INTAKE_HEARTBEAT_PERIOD="15s")
    done = cli("gaps", "--since", "4h", env=env)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        assert len(line) <= WIDTH, line
    said = " ".join(done.stdout.split())
    assert "no receiver seen" in said
    # The kind's cell wraps within its column: "database" on the row, the rest below it.
    assert "database every source 41 unreachable (503 answered)" in said, done.stdout
    assert "does not retry by itself: only reconciliation recovers it" in said
    assert "retries until" in said
    for name in ("gaps-stripe", "gaps-github", "gaps-shopify"):
        assert name in said
    assert "(the database's clock)" in said
    assert "a sender that never reached us (its DNS, its network," in said
    assert "`webhooks reconcile SOURCE` compares with the provider's own list" in said


def test_gaps_refuses_a_bad_since_in_one_line_with_its_docs_section() -> None:
    """Like the other CLI errors: one line, nothing else printed, ending with the docs
    section that explains the option (`webhooks gaps`)."""
    bad = cli("gaps", "--since", "soon", env=test_env(COLUMNS=str(WIDTH)))
    assert bad.returncode == 1
    assert bad.stdout == ""
    [line] = bad.stderr.strip().splitlines()
    assert line.startswith("error: --since: not a duration: 'soon' (use e.g. "), line
    assert line.endswith(f"(see {TOPICS['gaps-command'].path})"), line
    assert TOPICS["gaps-command"].path == "docs/provider-side-gaps.md#webhooks-gaps"
